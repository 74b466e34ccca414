"""LoRA adapters in peft's format (chunkcache/model/adapter.py), against peft itself.

The oracle is transformers with the adapter attached by peft (unmerged: peft computes the low-rank
path on the fly), so the engine's load-time merge is checked against the library that wrote the
file, logprob for logprob and token for token.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from chunkcache import LLM, SamplingParams
from chunkcache.errors import ModelLoadError

peft = pytest.importorskip("peft")

PROMPT = "Alice lives in Paris and drinks tea every morning. Where does Alice live?"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model(path: Path, rank: int = 4, alpha: float = 8.0, **config) -> torch.nn.Module:
    """transformers' model of `path` with a LoRA whose B is random (peft starts it at zero, which
    would make any merge, right or wrong, the identity)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    lora = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0, **config)
    model = peft.get_peft_model(base, lora)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def adapted(checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory):
    path = checkpoint(arch="llama")
    model = _peft_model(path)
    out = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(str(out))
    return path, out, model


def test_merged_adapter_matches_peft(adapted) -> None:
    path, adapter_dir, model = adapted
    llm = LLM(str(path), dtype="float32", adapter=str(adapter_dir), enable_chunk_cache=False)
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    out = llm.generate([ids], params)[0]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        ref = torch.log_softmax(logits.float(), dim=-1)
        new = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=8,
            eos_token_id=None,
        )[0, len(ids) :].tolist()
    for token, lp in out.outputs[0].logprobs[0].items():
        assert abs(ref[token].item() - lp) < 1e-4, (token, ref[token].item(), lp)
    assert out.outputs[0].token_ids == new
    # The adapter changes the model: without it the first step's log-probs differ.
    plain = LLM(str(path), dtype="float32", enable_chunk_cache=False).generate([ids], params)[0]
    top = max(plain.outputs[0].logprobs[0], key=plain.outputs[0].logprobs[0].get)
    assert abs(plain.outputs[0].logprobs[0][top] - ref[top].item()) > 1e-3


def _copy(adapter_dir: Path, tmp_path: Path, **config_changes) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(adapter_dir, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    config.update(config_changes)
    (bad / "adapter_config.json").write_text(json.dumps(config))
    return bad


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"r": 2}, "rank 2"),
    ],
)
def test_adapter_that_would_merge_wrong_is_refused(adapted, tmp_path: Path, changes, message: str) -> None:
    path, adapter_dir, _ = adapted
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(path), adapter=str(_copy(adapter_dir, tmp_path, **changes)))


def test_adapter_for_another_model_or_no_adapter_is_refused(adapted, checkpoint, tmp_path: Path) -> None:
    _, adapter_dir, _ = adapted
    wider = checkpoint(arch="llama", hidden_size=96)
    with pytest.raises(ModelLoadError, match="another model"):
        LLM(str(wider), adapter=str(adapter_dir))
    with pytest.raises(ModelLoadError, match="not a peft LoRA directory"):
        LLM(str(checkpoint(arch="llama")), adapter=str(tmp_path))
