"""Random PEFT adapters for tests, made with PEFT itself (init_lora_weights=False)."""

from __future__ import annotations

from pathlib import Path

import torch

# name -> LoraConfig kwargs: different ranks, target sets, one rsLoRA
ADAPTER_SPECS: dict[str, dict] = {
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-r8": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ),
    "mlp-rs16": dict(r=16, lora_alpha=4, use_rslora=True, target_modules=["o_proj", "gate_proj", "down_proj"]),
    "ku-r2": dict(r=2, lora_alpha=2, target_modules=["k_proj", "up_proj"]),
}


def make_peft_adapter(base_dir: Path, out_dir: Path, seed: int, b_scale: float = 1.0, **lora_kwargs) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, lora_dropout=0.0, **lora_kwargs)
    peft_model = get_peft_model(model, config)
    if b_scale != 1.0:
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.mul_(b_scale)
    peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def peft_greedy(
    base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], max_new: list[int]
) -> list[list[int]]:
    """Reference: PEFT (or the bare base model) alone, one prompt at a time, greedy, fp32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    outs = []
    for ids, n in zip(prompts, max_new, strict=True):
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False)
        outs.append(out[0, len(ids) :].tolist())
    return outs


def teacher_forced(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Score `tokens` after `prompt` with a transformers/PEFT model in one forward pass: the log-probability
    of each token [n] and the best log-probability at its position [n]."""
    with torch.no_grad():
        logp = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    return logp.gather(1, torch.tensor(tokens)[:, None])[:, 0], logp.max(-1).values
