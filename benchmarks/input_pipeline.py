"""Input-pipeline throughput on one CPU core: tokens/s of packed batches, beside SeqIO.

Why: a small model on a fast GPU is input-bound (Rosetta's GPT126M is "particularly
dataloading-bottlenecked"), so the host pipeline must deliver packed rows well ahead of the step.
This measures paxlite's `TextData.train_iterator()` (Grain over ArrayRecord -> concat-then-split
packing -> batches with inputs/targets/weights/positions/segment_ids) in two cases:

    tokens  pre-tokenized ArrayRecord (`prepare --vocab_path`) -> packed batches
    text    raw-text ArrayRecord -> SentencePiece encode on the fly -> packed batches

and, when the `seqio` extra is installed, the SeqIO pipeline Pax used on the same documents and
vocabulary (SentencePieceVocabulary, FunctionDataSource, Pax's `the_pile_lm` preprocessing: rekey
-> tokenize -> reduce_concat_tokens -> split_tokens_to_targets_length -> append_eos_after_trim,
then DecoderFeatureConverter(pack=True)). Only real tokens (weight 1) count.
The `mixture` case reads a DATA_MIXTURE of three sources (data/mixture.py: Grain's interleave picks
the source of every row, each source keeps its own packed stream) over the pre-tokenized dataset,
weights 0.5/0.3/0.2, beside `tokens` (one source, the same data): the cost of mixing per core.
A diagnostic case, `plays`, packs the same pre-tokenized text stored as one document per play
(~40 long documents instead of ~38,000 paragraphs of ~39 tokens), which separates the pipeline's
per-document cost from its per-token cost. SentencePiece's own encode rate over the train
documents is printed as the ceiling for raw text.

The process pins itself to one CPU (`--cpu`, default 0) before anything else, so every number is
per core; each window also reports its CPU share (process CPU time / wall time) to show whether
a shared host took the core away. Data: Shakespeare's works (`paxlite.demo.fetch_texts`), a BPE
tokenizer of 8000 pieces and the three prepared datasets, all cached in `build/bench_input/`.
Each case warms up, then reports the median of `--rounds` timed windows; `--tokens` real tokens
are timed in total for pre-tokenized 2048x8 (and `plays`), half that for the demo shape 128x16,
and 1/`--text_divisor` of it for raw text and SeqIO (SeqIO at least three packing groups of
seq_len**2 tokens per round, see `main`). Ratios are to the tokens/s GPT126M consumes
on one H200 at 100 % MFU (1,157,192) and to Rosetta's measured H100 rate (150,692 tokens/s/GPU).

    .venv/bin/python benchmarks/input_pipeline.py --rounds 3 --tokens 20000000
    .venv/bin/python benchmarks/input_pipeline.py --cases tokens,mixture --tokens 4000000
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import importlib.metadata
import importlib.util
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import grain
import numpy as np

from paxlite.data import records
from paxlite.data.mixture import MixtureData, MixtureDataConfig, MixtureSource
from paxlite.data.pipeline import TextData, TextDataConfig
from paxlite.data.prepare import prepare
from paxlite.data.tokenizer import Tokenizer
from paxlite.data.train_tokenizer import train_tokenizer
from paxlite.demo import fetch_texts

# GPT126M (S 2048) at 100 % MFU on one H200 (989 TFLOP/s BF16); docs/training.md, "FLOPs per
# token and MFU", derives it.
IDEAL_H200_GPT126M_TOKENS_PER_S = 1_157_192
# Rosetta's published Pax GPT126M, TE BF16, measured per H100 (the same section of training.md).
ROSETTA_H100_GPT126M_TOKENS_PER_S = 150_692
GOAL_FACTOR = 10  # pre-tokenized input should feed >= 10 H200s' worth of GPT126M per core
VOCAB_SIZE = 8000
NUM_SHARDS = 4
VALIDATION_FRACTION = 0.01
SEQIO_MISSING = "seqio not installed: SeqIO comparison skipped (pip install 'paxlite[seqio]')"
# Pax shuffles the_pile_lm's pieces with a 100,000-example buffer; at 2048 tokens a piece that is
# ~200M tokens to fill before the first batch, so the benchmark uses SeqIO's default of 1,000.
SEQIO_SHUFFLE_BUFFER = 1000
Batch = dict[str, np.ndarray]


class Pipeline(str, enum.Enum):
    TOKENS = "tokens"  # paxlite, pre-tokenized records
    TEXT = "text"  # paxlite, raw text tokenized on the fly
    SEQIO = "seqio"  # SeqIO on the same raw text
    PLAYS = "plays"  # paxlite, pre-tokenized, one document per play: the per-document cost removed
    MIXTURE = "mixture"  # paxlite, pre-tokenized, a 3-source DATA_MIXTURE of the `tokens` data


MIXTURE_WEIGHTS = (0.5, 0.3, 0.2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    """One batch shape; `share` is the fraction of `--tokens` its pre-tokenized case times."""

    seq_len: int
    batch_size: int
    share: float

    @property
    def name(self) -> str:
        return f"{self.seq_len}x{self.batch_size}"


# The realistic LM shape (GPT126M's sequence length) and the demo model's (TinyShakespeare).
# The demo shape is secondary: half the tokens keeps a default run under ~3 minutes.
SHAPES = (
    Shape(seq_len=2048, batch_size=8, share=1.0),
    Shape(seq_len=128, batch_size=16, share=0.5),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Datasets:
    """Everything cached under the work directory."""

    texts: str
    vocab_path: str
    tokens_dir: str
    text_dir: str
    plays_dir: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result:
    pipeline: Pipeline
    shape: Shape
    rounds: tuple[float, ...]  # real tokens/s (wall clock) of each timed window
    cpu_shares: tuple[float, ...]  # process CPU time / wall time of each window (1.0: whole core)
    tokens_per_round: int

    @property
    def median(self) -> float:
        return statistics.median(self.rounds)


def prepare_data(work_dir: str) -> Datasets:
    """Fetches the texts, builds the tokenizer and three datasets once; later runs reuse them."""
    os.makedirs(work_dir, exist_ok=True)
    texts = fetch_texts(work_dir)
    prefix = os.path.join(work_dir, f"shakespeare_{VOCAB_SIZE}")
    vocab_path = prefix + ".model"
    if not os.path.isfile(vocab_path):
        print(f"training a {VOCAB_SIZE}-piece tokenizer -> {vocab_path}", flush=True)
        train_tokenizer([texts], prefix, vocab_size=VOCAB_SIZE)
    dirs = {}
    # name -> (vocabulary or None for raw text, one document per file instead of per paragraph)
    for name, vocab, per_file in (
        ("tokens", vocab_path, False), ("text", None, False), ("plays", vocab_path, True)
    ):
        data_dir = os.path.join(work_dir, f"data_{name}")
        if not os.path.isfile(os.path.join(data_dir, records.MANIFEST)):
            print(f"preparing the {name} dataset -> {data_dir}", flush=True)
            prepare([texts], data_dir, vocab_path=vocab, num_shards=NUM_SHARDS,
                    validation_fraction=VALIDATION_FRACTION, seed=0, document_per_file=per_file)
        dirs[name] = data_dir
    return Datasets(
        texts=texts, vocab_path=vocab_path, tokens_dir=dirs["tokens"], text_dir=dirs["text"],
        plays_dir=dirs["plays"],
    )


def paxlite_batches(data_dir: str, *, vocab_path: str, shape: Shape) -> Iterator[Batch]:
    """The product path: the same iterator `Run.train()` draws its host batches from."""
    config = TextDataConfig(
        data_dir=data_dir, vocab_path=vocab_path, vocab_size=VOCAB_SIZE, seq_len=shape.seq_len,
        packed=True, shuffle=True, seed=0,
    )
    return TextData(config, global_batch_size=shape.batch_size).train_iterator()


def mixture_batches(data_dir: str, *, vocab_path: str, shape: Shape) -> Iterator[Batch]:
    """A three-source mixture of `data_dir` (each source its own stream): what `Run.train()` draws
    from with DATA_MIXTURE, on the same documents as `paxlite_batches`."""
    config = MixtureDataConfig(sources=[
        MixtureSource(name=f"part{i}", weight=weight, data=TextDataConfig(
            data_dir=data_dir, vocab_path=vocab_path, vocab_size=VOCAB_SIZE, seq_len=shape.seq_len,
            packed=True, shuffle=True, seed=0))
        for i, weight in enumerate(MIXTURE_WEIGHTS)])
    return MixtureData(config, global_batch_size=shape.batch_size).train_iterator()


def train_documents(text_dir: str) -> list[str]:
    """The raw-text train split's documents, in file order (what SeqIO is given)."""
    info = records.read_info(text_dir)
    source = grain.sources.ArrayRecordDataSource(records.shard_paths(info, "train"))
    return [str(records.decode_record(info.kind, source[i])) for i in range(len(source))]


def seqio_batches(documents: list[str], *, vocab_path: str, shape: Shape) -> Iterator[Batch]:
    """Pax's SeqIO LM pipeline (`the_pile_lm`) over `documents` (needs the `seqio` extra).

    The preprocessors are Pax's, from `paxlite.data.seqio_tasks`: the ids of every 128
    documents are joined without separators and cut into pieces of `seq_len - 1` plus EOS, so
    nothing is dropped; SeqIO's packer then fills rows with those pieces and may leave padding at
    row ends, which costs time but is not counted (only decoder_loss_weights == 1 is). Only the
    source differs from Pax: a FunctionDataSource over the in-memory documents, not TFDS files.
    """
    import seqio  # the optional extra: imported only on this path
    import tensorflow as tf

    from paxlite.data import seqio_tasks

    def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
        del split, shuffle_files, seed  # one in-memory split; the task shuffles examples
        return tf.data.Dataset.from_tensor_slices({"text": documents})

    vocabulary = seqio.SentencePieceVocabulary(vocab_path)
    task = seqio.Task(
        name="paxlite_bench_shakespeare",
        source=seqio.FunctionDataSource(dataset_fn=dataset_fn, splits=["train"]),
        preprocessors=[
            functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
            seqio.preprocessors.tokenize,
            seqio_tasks.reduce_concat_tokens,
            seqio_tasks.split_tokens_to_targets_length,
            seqio.preprocessors.append_eos_after_trim,
        ],
        output_features={"targets": seqio.Feature(vocabulary=vocabulary, add_eos=True)},
        shuffle_buffer_size=SEQIO_SHUFFLE_BUFFER,
    )
    lengths = {"targets": shape.seq_len}
    dataset = task.get_dataset(lengths, split="train", shuffle=True, seed=0, num_epochs=None)
    dataset = seqio.DecoderFeatureConverter(pack=True)(dataset, lengths)
    dataset = dataset.batch(shape.batch_size, drop_remainder=True)
    return iter(dataset.as_numpy_iterator())


def real_tokens(batch: Batch) -> int:
    """Tokens with loss weight 1 (paxlite `weights`, SeqIO `decoder_loss_weights`)."""
    weights = batch["weights"] if "weights" in batch else batch["decoder_loss_weights"]
    return int(np.count_nonzero(weights))


def time_rounds(
    batches: Iterator[Batch], *, warmup_tokens: int, tokens: int, rounds: int
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(tokens/s, CPU share) of `rounds` consecutive windows of >= `tokens` real tokens.

    The CPU share (process CPU time over wall time; pinned, so at most 1) shows how much of the
    core the pipeline actually got on a shared host.
    """
    seen = 0
    while seen < warmup_tokens:
        seen += real_tokens(next(batches))
    rates, shares = [], []
    for _ in range(rounds):
        count = 0
        wall, cpu = time.perf_counter(), time.process_time()
        while count < tokens:
            count += real_tokens(next(batches))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        rates.append(count / wall)
        shares.append(cpu / wall)
    return tuple(rates), tuple(shares)


def check_same_data(datasets: Datasets, shape: Shape) -> None:
    """Both paxlite cases must yield identical batches, so their speeds are comparable.

    Same documents, order, shuffle seed and tokenizer: tokenizing at prepare time or on the fly
    must not change a single token. Compares the first two batches.
    """
    first = paxlite_batches(datasets.tokens_dir, vocab_path=datasets.vocab_path, shape=shape)
    second = paxlite_batches(datasets.text_dir, vocab_path=datasets.vocab_path, shape=shape)
    for index in range(2):
        a, b = next(first), next(second)
        for key in a:
            if not np.array_equal(a[key], b[key]):
                raise AssertionError(
                    f"batch {index} feature {key!r} differs between the tokens and text datasets "
                    f"at shape {shape.name}; the comparison would not be like for like"
                )
        if real_tokens(a) != shape.seq_len * shape.batch_size:
            raise AssertionError(
                f"packed batch {index} at {shape.name} has {real_tokens(a)} real tokens, expected "
                f"{shape.seq_len * shape.batch_size} (concat-then-split leaves no padding)"
            )


def measure(
    pipeline: Pipeline,
    shape: Shape,
    *,
    make: Callable[[], Iterator[Batch]],
    tokens: int,
    rounds: int,
    warmup_tokens: int = 0,
) -> Result:
    """Times one case; `tokens` is split evenly over the rounds."""
    per_round = max(tokens // rounds, 1)
    # Warm-up: open every shard and fill the packer's buffer before the clock starts.
    warmup = max(8 * shape.seq_len * shape.batch_size, 100_000, warmup_tokens)
    rates, shares = time_rounds(make(), warmup_tokens=warmup, tokens=per_round, rounds=rounds)
    result = Result(
        pipeline=pipeline, shape=shape, rounds=rates, cpu_shares=shares, tokens_per_round=per_round
    )
    print(describe(result), flush=True)
    return result


def describe(result: Result) -> str:
    rounds = ", ".join(f"{r / 1e6:.3f}" for r in result.rounds)
    shares = ", ".join(f"{c:.2f}" for c in result.cpu_shares)
    return (
        f"{result.pipeline.value:<6} {result.shape.name:>6}  {result.median / 1e6:6.3f} M "
        f"tokens/s/core  x{result.median / IDEAL_H200_GPT126M_TOKENS_PER_S:.3f} ideal H200 "
        f"GPT126M  x{result.median / ROSETTA_H100_GPT126M_TOKENS_PER_S:.2f} Rosetta H100  "
        f"(rounds {rounds}; {result.tokens_per_round:,} tokens each; CPU share {shares})"
    )


def sentencepiece_rate(datasets: Datasets) -> float:
    """tokens/s of SentencePiece alone, one encode call per train document: raw text's ceiling."""
    tokenizer = Tokenizer(datasets.vocab_path)
    documents = train_documents(datasets.text_dir)
    tokenizer.encode(documents[0])
    start = time.perf_counter()
    count = sum(len(tokenizer.encode(document)) for document in documents)
    return count / (time.perf_counter() - start)


def versions() -> str:
    names = ("grain", "array_record", "sentencepiece", "numpy", "seqio", "tensorflow")
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"python {platform.python_version()}, " + ", ".join(found)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed windows per case (>= 3)")
    parser.add_argument("--tokens", type=int, default=20_000_000,
                        help="real tokens timed (over all rounds) for pre-tokenized 2048x8; "
                        "128x16 times half")
    parser.add_argument("--text_divisor", type=int, default=10,
                        help="raw text and SeqIO time 1/this of the pre-tokenized token count")
    parser.add_argument("--work_dir", default="build/bench_input",
                        help="cache for the texts, tokenizer and both datasets")
    parser.add_argument("--cpu", type=int, default=0, help="the one CPU to pin the process to")
    parser.add_argument("--cases", default=",".join(p.value for p in Pipeline),
                        help="comma-separated cases to run (default: all)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.rounds < 3:
        raise SystemExit(f"--rounds must be >= 3 (the median of at least 3), got {args.rounds}")
    for name in ("tokens", "text_divisor"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    try:
        cases = {Pipeline(name.strip()) for name in args.cases.split(",")}
    except ValueError:
        raise SystemExit(f"--cases {args.cases!r}: each must be one of "
                         f"{[p.value for p in Pipeline]}") from None
    allowed = sorted(os.sched_getaffinity(0))
    if args.cpu not in allowed:
        raise SystemExit(f"--cpu {args.cpu} is not one of this process's CPUs {allowed}")
    # Before any thread pool exists, so every thread (SentencePiece, TF) inherits the pin.
    os.sched_setaffinity(0, {args.cpu})
    print(f"pinned to CPU {sorted(os.sched_getaffinity(0))} of {os.cpu_count()}; "
          f"load average {os.getloadavg()[0]:.2f}; {versions()}", flush=True)

    datasets = prepare_data(os.path.abspath(args.work_dir))
    split = records.read_info(datasets.tokens_dir).splits["train"]
    assert split.tokens is not None  # a tokens dataset always counts its tokens
    per_document = (split.tokens + split.documents) / split.documents
    print(f"train split: {split.documents:,} documents, {split.tokens:,} tokens + "
          f"{split.documents:,} EOS per epoch ({per_document:.1f} per document), "
          f"vocab {VOCAB_SIZE}", flush=True)
    have_seqio = Pipeline.SEQIO in cases and importlib.util.find_spec("seqio") is not None
    if Pipeline.SEQIO in cases and not have_seqio:
        print(SEQIO_MISSING, flush=True)
    documents = train_documents(datasets.text_dir) if have_seqio else []

    results: list[Result] = []
    for shape in SHAPES:
        check_same_data(datasets, shape)
        tokens = int(args.tokens * shape.share)
        for pipeline, reader, data_dir, budget in (
            (Pipeline.TOKENS, paxlite_batches, datasets.tokens_dir, tokens),
            (Pipeline.MIXTURE, mixture_batches, datasets.tokens_dir, tokens),
            (Pipeline.TEXT, paxlite_batches, datasets.text_dir, tokens // args.text_divisor),
        ):
            if pipeline not in cases:
                continue
            make = functools.partial(reader, data_dir, vocab_path=datasets.vocab_path, shape=shape)
            results.append(measure(pipeline, shape, make=make, tokens=budget, rounds=args.rounds))
        by_case = {r.pipeline: r for r in results if r.shape == shape}
        if Pipeline.TOKENS in by_case and Pipeline.MIXTURE in by_case:
            print(
                f"       {shape.name:>6}  3-source mixture / one source = "
                f"{by_case[Pipeline.MIXTURE].median / by_case[Pipeline.TOKENS].median:.2f}",
                flush=True,
            )
        if have_seqio:
            make = functools.partial(
                seqio_batches, documents, vocab_path=datasets.vocab_path, shape=shape
            )
            text = by_case.get(Pipeline.TEXT)
            # SeqIO's packer works on groups of seq_len pieces (seq_len**2 tokens: 4.2M at 2048)
            # and then serves that group's rows at no cost: warm up over one group and time at
            # least three per round, or a window may only read rows packed before it began.
            group = shape.seq_len**2
            seqio = measure(Pipeline.SEQIO, shape, make=make, warmup_tokens=group,
                            tokens=max(tokens // args.text_divisor, args.rounds * 3 * group),
                            rounds=args.rounds)
            results.append(seqio)
            if text is not None:
                print(f"       {shape.name:>6}  paxlite text / SeqIO = "
                      f"{text.median / seqio.median:.2f}", flush=True)
    if Pipeline.PLAYS in cases:
        # Diagnostic: the same tokens as ~40 long documents, so per-document overhead nearly
        # vanishes.
        make = functools.partial(
            paxlite_batches, datasets.plays_dir, vocab_path=datasets.vocab_path, shape=SHAPES[0]
        )
        results.append(measure(Pipeline.PLAYS, SHAPES[0], make=make, tokens=args.tokens,
                               rounds=args.rounds))
    if Pipeline.TOKENS not in cases:
        return 0

    spm_rate = sentencepiece_rate(datasets)
    print(f"SentencePiece encode alone: {spm_rate / 1e6:.3f} M tokens/s/core "
          f"(x{spm_rate / IDEAL_H200_GPT126M_TOKENS_PER_S:.3f} ideal H200 GPT126M); "
          "the ceiling for raw text")
    for result in results:
        if result.pipeline in (Pipeline.TOKENS, Pipeline.TEXT):
            print(f"{result.pipeline.value:<6} {result.shape.name:>6}  "
                  f"{1e6 * per_document / result.median:6.1f} us per {per_document:.1f}-token "
                  "document")
    goal = GOAL_FACTOR * IDEAL_H200_GPT126M_TOKENS_PER_S
    best = results[0]  # pre-tokenized at the realistic shape
    verdict = "met" if best.median >= goal else "NOT met"
    print(f"goal: pre-tokenized {best.shape.name} >= {GOAL_FACTOR} x "
          f"{IDEAL_H200_GPT126M_TOKENS_PER_S:,} = {goal:,} tokens/s/core: {verdict} "
          f"({best.median:,.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
