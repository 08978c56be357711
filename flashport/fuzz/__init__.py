"""Fuzz tier of `flashport check` (issue [5]): random calls of the whole contract -- attention,
attention_varlen, attention_with_kvcache (dense and paged), merge_attention_states -- each checked against
the float64 reference under flashport.check's tolerance rule, forward and every gradient.

    python -m flashport.fuzz --n 5000 --seed 0 --device cuda --log fuzz.jsonl     # workers: min(8, cores)
    python -m flashport.fuzz --seed 0 --case 1234 ...                              # one failure again
    flashport check --fuzz N --seed S --log PATH                                   # the same, via the CLI

Case i of seed s is drawn from its own RNG (flashport.fuzz.cases.draw_case), so `--case i --seed s`
reproduces it exactly; the log holds each case's full description (JSON), its quantities (err, bound),
the kernel variants that served it (flashport.fuzz.variants), and a final summary line.
Modules: cases (the generator), execute (one case and its checks), variants (which kernel served it),
driver (workers, log, summary, command line).
"""
from .cases import FuzzCase, draw_case
from .driver import cli, format_summary, main, run_fuzz, summarize
from .execute import run_case
from .variants import Recorder

__all__ = ["FuzzCase", "draw_case", "run_case", "Recorder", "main", "cli", "run_fuzz", "summarize",
           "format_summary"]
