"""Benchmark (not a test): convert a Llama-3.1-8B-shaped EAGLE-3 drafter at r = 512 on the CPU.

Builds a drafter with Llama-3.1-8B-Instruct's drafter geometry (d 4096, I 14336, H 32, H_kv 8,
one layer, fc over 3 x 4096, full-vocabulary head V 128256 x 4096, bf16, random weights) in the
SpecForge layout (``LlamaForCausalLMEagle3``, ``midlayer.*``, ``model.safetensors``) in a temporary
folder, then runs ``slimspec convert SRC OUT --rank 512`` in a child process and prints its wall
time and peak RSS (``ru_maxrss`` of that child, from ``os.wait4``) against the checkpoint size.
Goals (issue 2): <= 30 s and peak RSS <= 2x the checkpoint bytes.

    python examples/bench_convert.py [--rank 512] [--svd-niter 1] [--workdir DIR] [--check-bound]

``--check-bound`` also computes the exact Eckart-Young error of the same head (float32 Gram
matrix + float64 eigenvalues, a few minutes on 2 cores) to show how far the randomized SVD is
from it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

D, INTER, HEADS, KV_HEADS, VOCAB, AUX = 4096, 14336, 32, 8, 128256, 3


def make_checkpoint(folder: Path, seed: int = 0) -> int:
    """Write the random bf16 SpecForge-layout drafter; returns the weight-file bytes."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    shapes = {
        "fc.weight": (D, AUX * D),
        "midlayer.input_layernorm.weight": (D,),
        "midlayer.hidden_norm.weight": (D,),
        "midlayer.self_attn.q_proj.weight": (HEADS * 128, 2 * D),
        "midlayer.self_attn.k_proj.weight": (KV_HEADS * 128, 2 * D),
        "midlayer.self_attn.v_proj.weight": (KV_HEADS * 128, 2 * D),
        "midlayer.self_attn.o_proj.weight": (D, HEADS * 128),
        "midlayer.post_attention_layernorm.weight": (D,),
        "midlayer.mlp.gate_proj.weight": (INTER, D),
        "midlayer.mlp.up_proj.weight": (INTER, D),
        "midlayer.mlp.down_proj.weight": (D, INTER),
        "norm.weight": (D,),
        "lm_head.weight": (VOCAB, D),
    }
    state = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.bfloat16)
        if len(shape) == 1:
            t.fill_(1.0)
        else:
            for i in range(0, shape[0], 8192):  # fill in blocks: no float32 copy of the whole tensor
                t[i : i + 8192] = torch.randn(min(8192, shape[0] - i), shape[1]) * 0.02
        state[name] = t
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {  # SpecForge configs/llama3-8B-eagle3.json geometry, with a full-vocabulary head
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": D,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "draft_vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "pad_token_id": 0,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return (folder / "model.safetensors").stat().st_size


def exact_bound(folder: Path, rank: int) -> float:
    """Eckart-Young relative error of the head at ``rank`` (float32 Gram, float64 eigenvalues)."""
    import torch

    from slimspec_convert.checkpoint.folders import open_weights

    W = open_weights(folder)[0]["lm_head.weight"].view()
    gram = torch.zeros(D, D, dtype=torch.float32)
    for i in range(0, W.shape[0], 8192):
        blk = W[i : i + 8192].float()
        gram.addmm_(blk.T, blk)
    torch.set_num_threads(1)  # LAPACK on 2 threads stalls when other jobs share the CPU (see factorize)
    eig = torch.linalg.eigvalsh(gram.double()).flip(0).clamp_min(0)
    return float((eig[rank:].sum() / eig.sum()).sqrt())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=512)
    parser.add_argument("--svd-niter", type=int, default=None, help="extra Krylov blocks (default: package)")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep the files here (default: a temp dir)"
    )
    parser.add_argument(
        "--check-bound", action="store_true", help="also compute the exact Eckart-Young error"
    )
    parser.add_argument(
        "--make", type=Path, default=None, help=argparse.SUPPRESS
    )  # child: write the checkpoint
    args = parser.parse_args()
    if args.make is not None:
        make_checkpoint(args.make)
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="slimspec-bench-"))
    src, out = work / "drafter-8b-specforge", work / f"drafter-8b-r{args.rank}"
    if not (src / "model.safetensors").is_file():
        t = time.perf_counter()  # in a child process, so this process stays small before the timed one
        subprocess.run([sys.executable, __file__, "--make", str(src)], check=True)
        print(f"wrote {src} in {time.perf_counter() - t:.1f} s")
    ckpt_bytes = (src / "model.safetensors").stat().st_size
    cmd = [
        sys.executable,
        "-c",
        "import sys; sys.argv[0] = 'slimspec'; from slimspec_convert.cli import main; main()",
        "convert",
        str(src),
        str(out),
        "--rank",
        str(args.rank),
        "--force",
        "--json",
    ]
    if args.svd_niter is not None:
        cmd += ["--svd-niter", str(args.svd_niter)]
    t = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    stdout = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall_s = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"convert failed with exit code {os.waitstatus_to_exitcode(status)}")
    report = json.loads(stdout)
    peak = usage.ru_maxrss * 1024  # Linux reports KiB
    print(f"command          : slimspec convert {src.name} {out.name} --rank {args.rank}")
    print(f"checkpoint bytes : {ckpt_bytes:,} ({ckpt_bytes / 2**30:.2f} GiB)")
    print(f"child wall time  : {wall_s:.1f} s  (goal <= 30 s; includes Python start-up and imports)")
    print(f"convert seconds  : {report['seconds']:.1f} s  (inside convert(), as in slimspec_report.json)")
    cpu_s = usage.ru_utime + usage.ru_stime
    print(f"child CPU time   : {cpu_s:.1f} s user+sys (2 threads: an idle 2-core machine needs about half)")
    print(f"child peak RSS   : {peak:,} bytes = {peak / ckpt_bytes:.2f}x checkpoint (goal <= 2x)")
    print(f"svd              : {report['svd_method']} niter={report['svd_niter']}")
    print(
        f"relative_error   : {report['relative_error']:.6f}; energy_retained {report['energy_retained']:.6f}"
    )
    print(f"load average     : {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (other jobs slow this down)")
    if args.check_bound:
        bound = exact_bound(src, args.rank)
        print(
            f"Eckart-Young     : {bound:.6f}  (randomized excess {report['relative_error'] / bound - 1:+.4%})"
        )
    if args.workdir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
