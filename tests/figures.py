"""Readable figures: everything drawn (titles, axis and tick labels, colour bars, legends) lies inside the figure."""

from matplotlib.figure import Figure


def assert_texts_inside(fig: Figure, tolerance: float = 0.01) -> None:
    """The tight bounding box of what is drawn (inches) lies within the figure: nothing is cut off when saved."""
    fig.canvas.draw()
    drawn, page = fig.get_tightbbox(fig.canvas.get_renderer()), fig.bbox_inches
    inside = (
        drawn.x0 >= page.x0 - tolerance
        and drawn.y0 >= page.y0 - tolerance
        and drawn.x1 <= page.x1 + tolerance
        and drawn.y1 <= page.y1 + tolerance
    )
    assert inside, f"drawn {drawn.bounds} spills out of the figure {page.bounds} (inches)"
