"""MTP drafting (``--drafter mtp``, issue 31) on a tiny DeepSeek V3 trained here, single stream, CPU, float32.

Random weights make any drafter's acceptance meaningless (~1/vocab), so this trains one first: the tests' tiny V3
shape (4 layers: 2 dense + 2 MoE, 8 routed experts in 2 groups, MLA with a query bottleneck, YaRN; ``--hidden``
scales every width from 64) plus one MTP
module (a fifth decoder layer, MoE, with ``enorm`` / ``hnorm`` / ``eh_proj`` / its own final norm, sharing the
embedding and output head), byte-level tokens of the Python standard library's sources, ``--steps`` AdamW steps
of the main next-token loss plus 0.3 x the MTP's token-after-next loss (the DeepSeek-V3 report's objective),
with transformers' own ``DeepseekV3DecoderLayer`` modules. The result is saved as a DeepSeek checkpoint (layer 4
= the MTP layer, ``num_nextn_predict_layers: 1``) and served by ``LLMEngine``: plain greedy decoding vs MTP
drafting with k = 1, 2, 3 on held-out files' prompts (sources the training never saw), one request at a time.
Printed per k: the same tokens as plain (checked), acceptance rate, tokens per target forward, tok/s and the
speed-up over plain decoding measured in the same run.

    python benchmarks/deepseek_mtp.py            # about 3 min on 2 CPU cores (training ~2 min)
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.speculator import SpecConfig, Speculator
from shared.model.loader import build_model, load_model_files
from shared.sampling import SamplingParams
from shared.spec.factory import make_drafter
from tests.deepseek_factory import VOCAB, v3_config
from tests.model_factory import tiny_hf_tokenizer

logger = logging.getLogger("deepseek_mtp")
LAYERS = 4


def corpus(tokenizer, train_files: int, eval_files: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Token ids of the first ``train_files`` stdlib modules (sorted by name) and of the next ``eval_files``."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    encode = lambda path: tokenizer.encode(path.read_text(errors="replace")).ids   # noqa: E731
    train = [t for f in files[:train_files] for t in encode(f)]
    held_out = [torch.tensor(encode(f)) for f in files[train_files:train_files + eval_files]]
    return torch.tensor(train), held_out


class TrainedPair(torch.nn.Module):
    """transformers' DeepseekV3ForCausalLM of ``LAYERS + 1`` layers; the last one is the MTP module's block."""

    def __init__(self, transformers, hidden: int) -> None:
        super().__init__()
        s = hidden // 64   # the tests' tiny shape at hidden 64, every width scaled with it
        config = transformers.DeepseekV3Config(**v3_config(
            num_hidden_layers=LAYERS + 1, hidden_size=hidden, intermediate_size=96 * s, moe_intermediate_size=32 * s,
            kv_lora_rank=32 * s, q_lora_rank=48 * s, qk_nope_head_dim=20 * s, v_head_dim=24 * s))
        config._attn_implementation = "sdpa"   # causal without a mask
        self.config = config
        self.lm = transformers.DeepseekV3ForCausalLM(config)
        d = config.hidden_size
        self.enorm, self.hnorm, self.mtp_norm = (torch.nn.RMSNorm(d, eps=config.rms_norm_eps) for _ in range(3))
        self.eh_proj = torch.nn.Linear(2 * d, d, bias=False)

    def losses(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x: [B, L]`` → (next-token loss, token-after-next loss of the MTP module)."""
        m = self.lm.model
        pos = torch.arange(x.shape[1])[None]
        emb = m.embed_tokens(x)  # [B, L, d]
        rot = m.rotary_emb(emb, pos)
        h = emb
        for layer in m.layers[:LAYERS]:
            h = layer(h, position_ids=pos, position_embeddings=rot)
        main = self.lm.lm_head(m.norm(h))  # [B, L, V]
        e = self.enorm(m.embed_tokens(x[:, 1:]))  # row i: token i + 1 beside the state h_i
        z = self.eh_proj(torch.cat([e, self.hnorm(h[:, :-1])], -1))  # [B, L - 1, d]
        rot_z = (rot[0][:, :-1], rot[1][:, :-1])
        z = m.layers[LAYERS](z, position_ids=pos[:, :-1], position_embeddings=rot_z)
        mtp = self.lm.lm_head(self.mtp_norm(z))  # [B, L - 1, V]: token i + 2
        return (F.cross_entropy(main[:, :-1].flatten(0, 1), x[:, 1:].flatten()),
                F.cross_entropy(mtp[:, :-1].flatten(0, 1), x[:, 2:].flatten()))

    def save(self, directory: Path, tokenizer) -> Path:
        """A DeepSeek checkpoint: ``LAYERS`` decoder layers, MTP layer ``LAYERS`` with its four extra tensors."""
        from safetensors.torch import load_file, save_file

        self.lm.save_pretrained(directory)
        raw = json.loads((directory / "config.json").read_text())
        raw.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
        (directory / "config.json").write_text(json.dumps(raw, indent=2))
        tensors = load_file(str(directory / "model.safetensors"))
        p = f"model.layers.{LAYERS}."
        tensors.update({p + "enorm.weight": self.enorm.weight, p + "hnorm.weight": self.hnorm.weight,
                        p + "eh_proj.weight": self.eh_proj.weight, p + "shared_head.norm.weight": self.mtp_norm.weight})
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"),
                  metadata={"format": "pt"})
        tokenizer.save(str(directory / "tokenizer.json"))
        return directory


def train(args, transformers, tokens: torch.Tensor) -> TrainedPair:
    torch.manual_seed(0)
    pair = TrainedPair(transformers, args.hidden)
    opt = torch.optim.AdamW(pair.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(tokens) - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([tokens[s:s + args.seq] for s in starts.tolist()])
        for group in opt.param_groups:   # linear warm-up, cosine decay
            warm = min(1.0, step / 30)
            group["lr"] = args.lr * warm * 0.5 * (1 + torch.cos(torch.tensor(step / args.steps * torch.pi)).item())
        main, mtp = pair.losses(x)
        opt.zero_grad()
        (main + 0.3 * mtp).backward()
        torch.nn.utils.clip_grad_norm_(pair.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps:
            logger.info("step %4d  loss %.3f  mtp loss %.3f  (%.0f s)", step, main.item(), mtp.item(),
                        time.perf_counter() - started)
    return pair.eval()


def serve(folder: Path, prompts: list[list[int]], max_tokens: int, k: int | None):
    """One request at a time, greedy; ``k`` None: plain decoding. → (outputs, seconds, speculator or None)."""
    config, weights, tokenizer = load_model_files(folder)
    eng = LLMEngine(build_model(config, weights, torch.float32, torch.device("cpu")),
                    EngineConfig(block_size=16, num_kv_blocks=256), tokenizer)
    spec = None
    if k is not None:
        spec = Speculator(make_drafter("mtp", eng.model), SpecConfig(k=k, max_batch=1))
        eng.set_speculator(spec)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    eng.generate(prompts[:1], params)   # warm-up (kernels, allocator)
    if spec is not None:
        spec.counters = type(spec.counters)()
    started = time.perf_counter()
    outputs = [eng.generate([p], params)[0] for p in prompts]
    return outputs, time.perf_counter() - started, spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--hidden", type=int, default=64, help="model width, a multiple of 64 (other widths scale)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--train-files", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="save the trained checkpoint here (reused when it exists)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    import transformers

    torch.set_num_threads(args.threads)
    tokenizer = tiny_hf_tokenizer(VOCAB)
    tokens, held_out = corpus(tokenizer, args.train_files, args.prompts)
    logger.info("training on %d tokens of %d stdlib files; hidden %d; %d steps of %d x %d", len(tokens),
                args.train_files, args.hidden, args.steps, args.batch, args.seq)
    prompts = [t[:args.prompt_len].tolist() for t in held_out if len(t) >= args.prompt_len]
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        if not (folder / "config.json").is_file():
            train(args, transformers, tokens).save(folder, tokenizer)
        plain, plain_s, _ = serve(folder, prompts, args.max_tokens, None)
        total = sum(len(o) for o in plain)
        logger.info("%d held-out prompts of %d tokens, %d new tokens each, one at a time", len(prompts),
                    args.prompt_len, args.max_tokens)
        logger.info("  plain decoding        %6.1f tok/s", total / plain_s)
        for k in (1, 2, 3):
            outputs, seconds, spec = serve(folder, prompts, args.max_tokens, k)
            stats = spec.stats()
            logger.info("  mtp k=%d  same tokens %-5s acceptance %.2f  tokens/target forward %.2f  %6.1f tok/s  "
                        "speed-up %.2fx", k, outputs == plain, stats["acceptance_rate"], stats["tokens_per_forward"],
                        total / seconds, plain_s / seconds)


if __name__ == "__main__":
    main()
