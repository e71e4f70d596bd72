"""LongCE: unit weights give CE, weights carry no gradient, padding is ignored, batch loss vs brute force."""

import pytest
import torch
import torch.nn.functional as F

from callbacks.longppl import first_short_index, token_logprobs
from losses.longce import longce_loss, longce_loss_for_batch, longce_weights, sliding_window_short_logprobs
from tests.test_longppl import VOCAB, TinyCausalLM, brute_force_logprobs

B, T, K, D = 3, 30, 6, 4
LENGTHS = [30, 22, 9]  # the last row is too short for any short context


@pytest.fixture(scope="module")
def model() -> TinyCausalLM:
    return TinyCausalLM(seed=2)


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) ids and attention mask."""
    input_ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    mask = torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]
    return input_ids.masked_fill(~mask, 0), mask


def scored_mask(mask: torch.Tensor) -> torch.Tensor:
    """Predicted real tokens of a right-padded batch: real and not the first token."""
    return mask & (torch.arange(mask.shape[1]) > 0)


def test_unit_weights_give_cross_entropy(batch):
    input_ids, mask = batch
    logits = torch.randn(B, T, VOCAB, generator=torch.Generator().manual_seed(2))
    logprobs = token_logprobs(logits, input_ids)
    weights = longce_weights(logprobs, logprobs.clone(), scored_mask(mask), gamma=5.0)  # LSD = 0
    targets = input_ids[:, 1:].masked_fill(~mask[:, 1:], -100)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
    assert torch.equal(weights, torch.ones_like(weights))
    torch.testing.assert_close(longce_loss(logprobs, weights, scored_mask(mask)), expected)


def test_weights_are_clipped_likelihood_ratios_and_one_without_short_context():
    long = torch.tensor([-1.0, -0.5, -3.0, -2.0, -0.1])
    short = torch.tensor([-2.0, -4.0, -1.0, -9.0, float("nan")])
    has_short = torch.tensor([True, True, True, False, False])
    expected = torch.tensor([torch.e, 5.0, torch.exp(torch.tensor(-2.0)).item(), 1.0, 1.0])
    torch.testing.assert_close(longce_weights(long, short, has_short, gamma=5.0), expected)


def test_weights_carry_no_gradient_and_loss_gradient_is_weighted_ce_gradient(batch):
    input_ids, mask = batch
    logits = torch.randn(B, T, VOCAB, generator=torch.Generator().manual_seed(3), requires_grad=True)
    logprobs = token_logprobs(logits, input_ids)
    short = logprobs.detach() + torch.randn(B, T, generator=torch.Generator().manual_seed(4))
    has_short = mask & (torch.arange(T) >= K)
    weights = longce_weights(logprobs, short, has_short, gamma=2.0)
    scored = scored_mask(mask)
    longce_loss(logprobs, weights, scored).backward()

    assert not weights.requires_grad
    assert (weights[has_short] != 1).any() and (weights == 2.0).any()
    # d(-w_j log p_j)/d logits_{j-1} = w_j (softmax - onehot), averaged over the scored tokens.
    ce_grad = logits.detach().softmax(-1) - F.one_hot(input_ids.roll(-1, dims=1), VOCAB)  # (B, T, V) at j-1
    weight_at_prev = (weights * scored).roll(-1, dims=1)[..., None]  # (B, T, 1): token j's weight at j-1
    torch.testing.assert_close(logits.grad, weight_at_prev * ce_grad / scored.sum())
    with pytest.raises(ValueError, match="no gradient"):
        longce_loss(logprobs, weights.requires_grad_(), scored)


def test_batch_loss_matches_brute_force(model, batch):
    input_ids, mask = batch
    gamma = 1.5
    expected_terms = []
    for row, length in enumerate(LENGTHS):
        long, short, has_short = brute_force_logprobs(model, input_ids[row, :length], K, D)
        weight = torch.where(has_short, (long - short).exp().clamp(max=gamma), 1.0)
        expected_terms.append(-(weight * long)[1:])
    expected_terms = torch.cat(expected_terms)

    loss = longce_loss_for_batch(model, input_ids, model(input_ids), mask, K, D, gamma, batch_size=3)

    torch.testing.assert_close(loss, expected_terms.mean())
    assert not torch.isclose(
        loss, F.cross_entropy(model(input_ids)[:, :-1][mask[:, 1:]], input_ids[:, 1:][mask[:, 1:]])
    )


def test_padding_tokens_and_logits_do_not_change_the_loss(model, batch):
    input_ids, mask = batch
    logits = model(input_ids)
    loss = longce_loss_for_batch(model, input_ids, logits, mask, K, D)
    other_ids = input_ids.masked_fill(~mask, 5)
    other_logits = torch.where(mask[..., None], logits, torch.randn_like(logits) * 100)
    torch.testing.assert_close(longce_loss_for_batch(model, other_ids, other_logits, mask, K, D), loss)


def test_short_context_starts_at_the_first_full_block_of_each_row(model, batch):
    input_ids, mask = batch
    short, has_short = sliding_window_short_logprobs(model, input_ids, mask, K, D)
    assert torch.equal(has_short, mask & (torch.arange(T) >= first_short_index(K, D)))
    assert not short[has_short].isnan().any() and short[~has_short].isnan().all()
