"""Gemma 3 on tiny random checkpoints (tests/gemma_factory.py): our loaders + model equal HF transformers' Gemma3
loaded from the same GGUF / HF folder, with sliding windows far smaller than the prompt; our SentencePiece
tokenizer equals transformers' tokenizer for the same GGUF; Gemma's chat template, BOS and stop tokens."""
import dataclasses

import pytest
import torch

from shared.errors import DeepinferError, ErrorCode
from shared.model import gemma3
from shared.model.gguf_loader import load_gguf
from shared.model.llama import LlamaModel
from shared.model.loader import load_model_files
from shared.model.tokenizer import Tokenizer
from tests.gemma_factory import (BOS_ID, EOT_ID, gemma_config, gemma_weights, write_gemma_gguf,
                                 write_gemma_hf_folder)
from tests.tiny_model import all_logits

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")
TEXTS = ["hello world", "  the   world\n\nis here", "日本 é😀 zzz", "<start_of_turn>user\nhi<end_of_turn>\n",
         "\t\tx<b>y</b>", "   leading and trailing   ", "a  b   c    d\n\n\n\ne", "<bos>text<eos>", "", " ",
         "the thing is a wonderful hello-world.\r\n", "ñandú ☃ 𝔘 \u00a0\u200b"]


def prompt(n: int, vocab: int) -> list[int]:
    return [BOS_ID] + [(17 * i + 5) % (vocab - 20) + 20 for i in range(n - 1)]  # skips the control ids


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-gguf")
    config = gemma_config(window=8)  # head_dim 256: what transformers assumes for a GGUF's query_pre_attn_scalar
    weights = gemma_weights(config, seed=1)
    return folder, write_gemma_gguf(folder / "tiny.gguf", config, weights), config, weights


def test_gguf_loads_gemma3_config_and_hf_convention_weights(tiny_gguf):
    _, path, config, weights = tiny_gguf
    got_config, got = load_gguf(path)
    assert got_config == config
    assert got_config.layer_sliding_windows == (8, 8, 8, 8, 8, None, 8)  # five of every six layers slide
    assert set(got) == set(weights) and all(torch.equal(got[k], weights[k]) for k in weights)  # 1 + w undone


def test_gguf_logits_match_transformers(tiny_gguf):
    folder, path, _, _ = tiny_gguf
    config, weights, _ = load_model_files(path)
    ours = LlamaModel(config, weights, torch.float32, CPU)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    assert hf.config.layer_types[5] == "full_attention" and hf.config.sliding_window == 8
    ids = prompt(50, config.vocab_size)  # 6x the window
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    diff = (all_logits(ours, ids) - expected).abs().max().item()
    assert diff < 1e-4, f"max-abs logit difference {diff}"


@pytest.mark.parametrize("rope_layout", ["v4", "v5"])
def test_hf_folder_matches_transformers_fp32_and_bf16(tmp_path, rope_layout):
    """head_dim 16 with query_pre_attn_scalar 24, linear RoPE scaling on the global layers only, window 6."""
    config = gemma_config(head_dim=16, heads=4, kv_heads=2, query_pre_attn_scalar=24, window=6,
                          rope_scaling={"rope_type": "linear", "factor": 4.0})
    folder = write_gemma_hf_folder(tmp_path / rope_layout, config, gemma_weights(config, seed=2),
                                   rope_layout=rope_layout)
    loaded, weights, tok = load_model_files(folder)
    assert dataclasses.replace(loaded, architecture="gemma3", model_id=config.model_id) == config
    assert tok.encode("hello")[0] == BOS_ID and EOT_ID in tok.eos_token_ids  # tokenizer_config / config.json
    ids = prompt(60, config.vocab_size)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
        with torch.inference_mode():
            logits["hf", dtype] = hf(torch.tensor([ids])).logits[0].float()
        logits["ours", dtype] = all_logits(LlamaModel(loaded, weights, dtype, CPU), ids).float()
    reference = logits["hf", torch.float32]
    diff = (logits["ours", torch.float32] - reference).abs().max().item()
    assert diff < 1e-4, f"float32: max-abs logit difference {diff}"
    assert torch.equal(logits["ours", torch.float32].argmax(-1), reference.argmax(-1))
    # bfloat16: two engines' kernels round at different places (a one-step difference in one attention output
    # moves these logits by ~0.08), so ours must be as close to the float32 reference as transformers' own
    # bfloat16 run is, and pick its tokens wherever the reference's top two are further apart than that error
    ours_error = (logits["ours", torch.bfloat16] - reference).abs().max().item()
    hf_error = (logits["hf", torch.bfloat16] - reference).abs().max().item()
    assert ours_error <= 1.25 * hf_error + 1e-3, (ours_error, hf_error)
    top2 = reference.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * max(ours_error, hf_error)
    assert clear.sum() >= len(ids) // 2  # the check below has rows to look at
    assert torch.equal(logits["ours", torch.bfloat16].argmax(-1)[clear], reference.argmax(-1)[clear])


def test_tokenizer_matches_transformers(tiny_gguf):
    folder, path, _, _ = tiny_gguf
    ours = Tokenizer.from_gguf(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=path.name)
    for text in TEXTS:
        ids = ref(text, add_special_tokens=False).input_ids
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
        if text and not text.startswith("<bos>"):
            assert ours.encode(text) == ref(text).input_ids, text  # <bos> first, as the GGUF asks
    assert ours.encode("<bos>hello") == ref("hello").input_ids  # never a second <bos> (transformers adds one)
    ids = ours.encode("日本 é😀 zzz ñandú ☃")  # byte-fallback pieces: streamed text never splits a character
    decoder = ours.incremental_decoder()
    pieces = [decoder.feed(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == ours.decode(ids) and not any("\ufffd" in p for p in pieces)


def test_chat_template_bos_and_stop_tokens(tiny_gguf):
    _, path, _, _ = tiny_gguf
    tok = Tokenizer.from_gguf(path)  # the GGUF has no tokenizer.chat_template, like the real 270M file
    assert tok.chat_template == gemma3.CHAT_TEMPLATE and tok.add_bos
    assert EOT_ID in tok.eos_token_ids and tok.id_to_token(EOT_ID) == "<end_of_turn>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hi "},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "the world?"}]
    text = tok.apply_chat_template(messages)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nhello"
                    "<end_of_turn>\n<start_of_turn>user\nthe world?<end_of_turn>\n<start_of_turn>model\n")
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and ids[1] != BOS_ID and ids.count(EOT_ID) == 3
    with pytest.raises(DeepinferError) as info:
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert info.value.code == ErrorCode.INVALID_REQUEST


def test_window_pattern_from_metadata_and_refusals(tmp_path):
    config = gemma_config(num_layers=4, window=8)
    weights = gemma_weights(config, seed=3)
    path = write_gemma_gguf(tmp_path / "p2.gguf", config, weights, pattern=2)
    assert load_gguf(path)[0].layer_sliding_windows == (8, None, 8, None)
    path = write_gemma_gguf(tmp_path / "bools.gguf", config, weights, pattern=[False, True, True, False])
    assert load_gguf(path)[0].layer_sliding_windows == (None, 8, 8, None)
    path = write_gemma_gguf(tmp_path / "none.gguf", config, weights, window=None)
    assert load_gguf(path)[0].layer_sliding_windows == (None,) * 4
    # a file asking for soft-capping (Gemma 2 has it, Gemma 3 does not) is refused rather than run wrongly
    path = write_gemma_gguf(tmp_path / "softcap.gguf", config, weights,
                            extra=lambda writer: writer.add_final_logit_softcapping(30.0))
    with pytest.raises(DeepinferError) as info:
        load_gguf(path)
    assert info.value.code == ErrorCode.MODEL_CORRUPT and "final_logit_softcapping" in info.value.message
