"""Prompts tokenized as the model expects (issue 38, item 5): raw text (/v1/completions, /generate, the engine's
own text prompts) gets the tokenizer's special tokens, as transformers, vLLM and TGI give it, so a Llama 3 or
Gemma base model sees its BOS; a chat prompt, whose template writes the BOS itself, holds exactly one (vLLM's rule:
the rendered template is encoded without adding special tokens); SmolLM2, whose tokenizer adds none, is unchanged.

The Llama-3-style and Gemma-style tokenizers are built here (no hub): a small vocabulary, a TemplateProcessing
post-processor that adds the BOS, saved with transformers' PreTrainedTokenizerFast and the tokenizer_config of
each family (Gemma's names GemmaTokenizer and add_bos_token)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_http_support import RecordingApp, recording_app
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from loraplane_server.sampling_params import SamplingParams

TEXT = "hello world. the capital of France is"
MESSAGES = [{"role": "user", "content": "hello world"}]

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_WORDS = "[UNK] hello world the capital of France is Hi there ok user assistant system ! ? . ,".split()
# Llama 3's template writes the BOS; `system_hint` is a variable a request may set (chat_template_kwargs)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{% if system_hint %}{{ '<|start_header_id|>system<|end_header_id|>' + system_hint + "
    "'<|eot_id|>' }}{% endif %}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>' "
    "+ m['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>' }}{% endif %}"
)
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\n' + m['content'] + "
    "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def save_llama3_tokenizer(path: Path) -> Path:
    """A Llama-3-style tokenizer: PreTrainedTokenizerFast (tokenizer_class TokenizersBackend), its
    post-processor adding <|begin_of_text|>, a chat template that writes it too."""
    vocab = {w: i for i, w in enumerate(LLAMA3_SPECIALS + LLAMA3_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(LLAMA3_SPECIALS)
    bos = LLAMA3_SPECIALS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token="<|eot_id|>", chat_template=LLAMA3_TEMPLATE
    )
    fast.save_pretrained(str(path))
    return path


def save_gemma_tokenizer(path: Path) -> Path:
    """A Gemma-style tokenizer: BPE with byte fallback over "▁"-joined text, <bos> added by the post-processor,
    saved with Gemma's tokenizer_config (tokenizer_class GemmaTokenizer, add_bos_token true)."""
    chars = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?\n") + ["▁"]
    vocab = {w: i for i, w in enumerate(GEMMA_SPECIALS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(GEMMA_SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=GEMMA_TEMPLATE,
    )
    fast.save_pretrained(str(path))
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(tokenizer_class="GemmaTokenizer", add_bos_token=True, add_eos_token=False)
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bos-tokenizers")
    return {
        "llama3": save_llama3_tokenizer(root / "llama3"),
        "gemma": save_gemma_tokenizer(root / "gemma"),
    }


@pytest.fixture(scope="module", params=["llama3", "gemma"])
def app(request: pytest.FixtureRequest, tokenizer_dirs: dict[str, Path]) -> RecordingApp:
    model_dir = tokenizer_dirs[request.param]
    return recording_app(AutoTokenizer.from_pretrained(str(model_dir)), model_dir)


def _completion(app: RecordingApp, **fields: object) -> list[int]:
    body = {"model": "base", "prompt": TEXT, "max_tokens": 1, "temperature": 0, **fields}
    r = app.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return app.last().prompt_ids


def _chat(app: RecordingApp, **fields: object) -> list[int]:
    body = {"model": "base", "messages": MESSAGES, "max_tokens": 1, "temperature": 0, **fields}
    r = app.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return app.last().prompt_ids


def test_the_tokenizers_are_the_families_they_stand_for(tokenizer_dirs: dict[str, Path]) -> None:
    llama3 = AutoTokenizer.from_pretrained(str(tokenizer_dirs["llama3"]))
    gemma = AutoTokenizer.from_pretrained(str(tokenizer_dirs["gemma"]))
    assert type(gemma).__name__ == "GemmaTokenizer" and gemma.bos_token == "<bos>"
    for tok in (llama3, gemma):
        ids = tok(TEXT)["input_ids"]
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
        assert ids[1:] == tok.encode(TEXT, add_special_tokens=False)


def test_raw_text_is_encoded_as_transformers_encodes_it(app: RecordingApp) -> None:
    tok = app.engine.tokenizer
    expected = tok(TEXT)["input_ids"]
    raw = Tokenizer.from_file(str(app.engine.model_dir / "tokenizer.json")).encode(TEXT).ids
    assert expected == raw and expected[0] == tok.bos_token_id
    assert app.engine.inputs.encode(TEXT) == expected
    # the engine's own text prompts take the same path
    assert app.engine.inputs.process(TEXT, SamplingParams(max_new_tokens=1)).token_ids == expected
    assert _completion(app) == expected
    assert _completion(app, prompt=[TEXT, TEXT]) == expected  # a batch of texts too
    r = app.client.post("/generate", json={"inputs": TEXT, "parameters": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text
    assert app.last().prompt_ids == expected


def test_token_id_prompts_and_add_special_tokens_false_get_no_bos(app: RecordingApp) -> None:
    tok = app.engine.tokenizer
    bare = tok.encode(TEXT, add_special_tokens=False)
    assert _completion(app, add_special_tokens=False) == bare  # vLLM's field, honoured
    assert _completion(app, prompt=bare) == bare  # token ids are taken as sent


def test_a_chat_prompt_holds_exactly_one_bos(app: RecordingApp) -> None:
    tok = app.engine.tokenizer
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith(tok.bos_token)  # the template writes it
    ids = _chat(app)
    assert ids == tok.encode(rendered, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    # vLLM's add_special_tokens asks for the tokenizer's on top of the template's: honoured, so two
    doubled = _chat(app, add_special_tokens=True)
    assert doubled[:2] == [tok.bos_token_id] * 2 and doubled[1:] == ids


def test_smollm2_adds_no_special_tokens_so_nothing_changes(smollm2_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    app = recording_app(tok, smollm2_dir)
    bare = tok.encode(TEXT, add_special_tokens=False)
    assert app.engine.inputs.encode(TEXT) == bare == _completion(app)
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert _chat(app) == tok.encode(rendered, add_special_tokens=False) == tok.encode(rendered)
