"""An exponential moving average (EMA) of the weights as the model a run hands out, beside the weights it trains.

Lightning's `EMAWeightAveraging` with one change: validation sees the weights being trained, not the average, so the
curriculum moves on, and the best checkpoint is picked, by the run itself, and a run takes the same steps with or
without this callback (tests/test_weight_average.py). The average is what the run hands out: the test of
`test=true` and every checkpoint's `state_dict` (what evaluate.py, `init_from` and a watcher read); the weights being
trained travel in the checkpoint beside it (`current_model_state`), so a resumed run continues both exactly.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import EMAWeightAveraging

from models.config_errors import ConfigError


class TrainedWeightsEMA(EMAWeightAveraging):
    """ema <- decay * ema + (1 - decay) * weights after every optimizer step (from the first); parameters only."""

    def __init__(self, decay: float = 0.999):
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"callbacks.weight_average.decay must lie in (0, 1), got {decay}")
        super().__init__(decay=decay, use_buffers=False)

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        pass  # validate the weights being trained (Lightning's swaps the average in)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        pass

    def on_train_end(self, trainer, pl_module) -> None:
        pass  # keep the trained weights in the module: the last checkpoint, written after this, must hold them

    def on_test_epoch_start(self, trainer, pl_module) -> None:
        if self._average_model is not None:  # a test after fit in the same process: test the average
            self._swap_models(pl_module)

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        if self._average_model is not None:
            self._swap_models(pl_module)
