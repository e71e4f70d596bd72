"""The WSD schedule and exact match (teacher-forced exact match == greedy decoding reproduces the answer)."""

import torch

from models.lit_module import exact_match, wsd_lambda
from models.llama import Llama, LlamaConfig
from models.lm import CausalLM


def test_wsd_schedule_warms_up_holds_and_decays():
    f = wsd_lambda(warmup_steps=10, total_steps=110, stable_ratio=0.8, min_lr_ratio=0.1)
    assert f(0) == 0.1 and f(9) == 1.0  # linear warmup
    assert f(10) == f(89) == 1.0  # stable for 80% of the 100 post-warmup steps
    assert abs(f(100) - 0.55) < 1e-9 and abs(f(110) - 0.1) < 1e-9  # linear decay to min_lr_ratio


def qa_batch(prompt: torch.Tensor, answers: list[list[int]]) -> dict:
    """Rows `prompt + answer`, scoring the answer tokens only."""
    rows = [torch.cat([prompt, torch.tensor(a)]) for a in answers]
    ids = torch.stack(rows)
    labels = torch.full_like(ids, -100)
    P = len(prompt)
    labels[:, P - 1 : -1] = ids[:, P:]
    return {"input_ids": ids, "labels": labels, "answer_mask": labels != -100}


def test_exact_match_equals_greedy_decoding():
    torch.manual_seed(0)
    lm = CausalLM(
        Llama(
            LlamaConfig(
                vocab_size=50,
                hidden_size=32,
                n_layers=2,
                n_heads=2,
                n_kv_heads=2,
                ffn_size=64,
                max_positions=64,
            )
        )
    ).eval()
    prompt = torch.randint(0, 50, (10,))
    greedy = lm.generate(prompt[None], max_new_tokens=3, eos_id=-1)[0]
    wrong_last = greedy[:2] + [(greedy[2] + 1) % 50]
    batch = qa_batch(prompt, [greedy, wrong_last])
    with torch.no_grad():
        out = lm(batch)
    assert exact_match(out.logits, out.targets, batch).tolist() == [1.0, 0.0]
