"""A small real dataset in Megatron's indexed format, from a text file in this repository, offline.

    python examples/data/prepare.py [--text FILE ...] [--out examples/data/out]

1. The text (by default this repository's README and documentation, docs/) is cut into documents
   (its paragraphs) and written as JSONL, one {"text": ...} a line.
2. A byte-level BPE tokenizer is trained on it (HF `tokenizers`, saved as a tokenizer directory that
   `AutoTokenizer` and Megatron-Bridge's `HuggingFaceTokenizer` load), so nothing is downloaded.
3. Megatron's preprocessing, as NVIDIA ships it for megatron-core (`modelopt.torch.utils.plugins.
   megatron_preprocess_data`, which writes with megatron-core's `IndexedDatasetBuilder`), turns the
   JSONL into `<out>/corpus_text.bin` and `.idx`, one end-of-document token after each document.

The prefix `<out>/corpus_text` is what `dataset.blend` names (recipes/gpt_small_text.yaml) and what
the dry run's tiny trainer reads with `--dry-run data=<out>/corpus_text`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB = 1024  # small: the dry run's tiny GPT and a short training run both learn it quickly
EOD = "<|endoftext|>"


def documents(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40]


def train_tokenizer(jsonl: Path, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[EOD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    texts = [json.loads(line)["text"] for line in jsonl.read_text().splitlines()]
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOD, bos_token=EOD).save_pretrained(out)


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = HERE.parent.parent
    texts = [str(root / "README.md"), *sorted(str(f) for f in (root / "docs").rglob("*.md"))]
    p.add_argument("--text", nargs="+", default=texts, help="default: README.md and docs/**/*.md")
    p.add_argument("--out", default=str(HERE / "out"), help="default: examples/data/out")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "corpus.jsonl"
    docs = [d for text in args.text for d in documents(Path(text).read_text())]
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train_tokenizer(jsonl, out / "tokenizer")
    for stale in (out / "corpus_text.bin", out / "corpus_text.idx"):  # the preprocessing skips existing
        stale.unlink(missing_ok=True)
    subprocess.run(
        [sys.executable, "-m", "modelopt.torch.utils.plugins.megatron_preprocess_data",
         "--jsonl_paths", str(jsonl), "--json_keys", "text", "--output_dir", str(out),
         "--tokenizer", str(out / "tokenizer"), "--append_eod", "--workers", "1"],
        check=True,
    )  # fmt: skip
    prefix = out / "corpus_text"
    made = f"{prefix}.bin and .idx; tokenizer {out / 'tokenizer'}"
    print(f"{len(docs)} documents from {len(args.text)} file(s): {made}")
    return prefix


if __name__ == "__main__":
    main()
