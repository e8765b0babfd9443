"""Every subcommand turns a damaged, truncated, missing or unsafe input into one line.

Each case runs `orthros.cli.main(argv)` in process and checks: exit code 2,
stderr exactly one line `orthros CMD: error: ...` naming the file and the
problem, no traceback, nothing in the input tree changed or created (hashed
before and after), and no pickle ever unpickled (inputs.MARKER never appears).
A count below its least is the parser's error instead: its usage, then one
line `orthros CMD: error: argument --FLAG: must be >= N, got X`, exit code 2.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from orthros.cli import main

from .inputs import MARKER, build_world, tree_digest

W = "{w}"  # the input tree; filled in per case


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("inputs"))


def gen(model, *extra, prompt="def main():"):
    return ["generate", f"{W}/{model}", "--prompt", prompt, "--max-new-tokens", "4", "--device", "cpu", *extra]


def train(*extra, out="cwd/runs/new"):
    return ["train", "--out_dir", f"{W}/{out}", "--model.name", "tiny", "--data.tokenizer", "bytes",
            "--data.max_bytes", "20000", "--data.seq_len", "32", "--train.steps", "2", "--train.batch_size", "2",
            "--train.device", "cpu", "--log.progress", "false", "--log.plot", "false", *extra]


def ev(model, *extra):
    return ["eval", f"{W}/{model}", "--device", "cpu", "--task", "mqar", "--mqar-lengths", "64", "--mqar-samples",
            "4", *extra]


def conv(src, *extra, dst="cwd/converted"):
    return ["convert", f"{W}/{src}", f"{W}/{dst}", "--window-size", "8", *extra]


def harness(model, *extra):
    return ["eval-harness", f"{W}/{model}", "--tasks", "arc_easy", "--device", "cpu", *extra]


PICKLE = "pickle-format checkpoint, refused"
CASES = [
    # ------------------------------------------------------------ generate
    ("gen-missing-dir", gen("nope"), ["{w}/nope", "not a model directory"]),
    ("gen-file-not-dir", gen("afile"), ["{w}/afile", "not a model directory"]),
    ("gen-no-config", gen("nodata"), ["{w}/nodata", "no config.json"]),
    ("gen-truncated-weights", gen("trunc"), ["{w}/trunc/model.safetensors", "truncated"]),
    ("gen-damaged-header", gen("hdr"), ["{w}/hdr/model.safetensors", "not a safetensors file or truncated"]),
    ("gen-trailing-bytes", gen("trailing"), ["{w}/trailing/model.safetensors", "damaged"]),
    ("gen-empty-weights", gen("zero"), ["{w}/zero/model.safetensors", "shorter than 8 bytes"]),
    ("gen-nan-weights", gen("nan"), ["{w}/nan", "model.embed_tokens.weight", "NaN"]),
    ("gen-pickle-bin", gen("pickle_bin"), ["{w}/pickle_bin/pytorch_model.bin", PICKLE, "safetensors only"]),
    ("gen-pickle-pt", gen("pickle_pt"), ["{w}/pickle_pt/model.pt", PICKLE]),
    ("gen-no-weights", gen("noweights"), ["{w}/noweights", "no model.safetensors"]),
    ("gen-missing-shard", gen("shard_missing"), ["{w}/shard_missing/model.safetensors.index.json", "do not exist"]),
    ("gen-bad-index", gen("index_bad"), ["{w}/index_bad/model.safetensors.index.json", "not valid JSON"]),
    ("gen-config-bad-json", gen("cfg_json"), ["{w}/cfg_json/config.json", "not valid JSON", "line 1"]),
    ("gen-config-not-object", gen("cfg_list"), ["{w}/cfg_list/config.json", "JSON object"]),
    ("gen-config-negative-size", gen("cfg_neg"), ["{w}/cfg_neg/config.json", "hidden_size", "positive integer"]),
    ("gen-config-window-0", gen("cfg_window0"), ["{w}/cfg_window0/config.json", "window_size", ">= 1"]),
    ("gen-config-heads-vs-hidden", gen("cfg_heads"), ["{w}/cfg_heads/config.json", "not divisible by"]),
    ("gen-config-kv-heads", gen("cfg_kv"), ["{w}/cfg_kv/config.json", "num_key_value_heads", "must divide"]),
    ("gen-config-not-orthros", gen("cfg_llama"), ["{w}/cfg_llama/config.json", "model_type is 'llama'",
                                                   "orthros convert"]),
    ("gen-config-fewer-layers", gen("cfg_layers"), ["{w}/cfg_layers/model.safetensors", "does not imply",
                                                     "model.layers.1"]),
    ("gen-config-vocab-mismatch", gen("cfg_vocab"), ["{w}/cfg_vocab/model.safetensors", "embed_tokens",
                                                      "[256, 64]", "[300, 64]"]),
    ("gen-missing-tokenizer", gen("notok"), ["{w}/notok", "no tokenizer files", "not byte-level"]),
    ("gen-damaged-tokenizer", gen("badtok"), ["{w}/badtok/tokenizer.json", "not valid JSON"]),
    ("gen-tokenizer-beyond-vocab", gen("bigtok"), ["{w}/bigtok", "outside the model's vocabulary",
                                                   "vocab_size=256"]),
    ("gen-empty-prompt", gen("byte", prompt=""), ["--prompt", "empty"]),
    ("gen-prompt-beyond-context", gen("byte", prompt="x" * 100),
     ["{w}/byte/config.json", "prompt (100 tokens)", "max_position_embeddings=64"]),
    ("gen-bad-device", gen("byte", "--device", "tpu0"), ["--device", "not a device"]),
    ("gen-absent-cuda-device", gen("byte", "--device", "cuda:99"), ["--device cuda:99"]),
    # --------------------------------------------------------------- serve
    ("serve-missing-dir", ["serve", f"{W}/nope", "--device", "cpu"], ["{w}/nope", "not a model directory"]),
    ("serve-truncated-weights", ["serve", f"{W}/trunc", "--device", "cpu"], ["{w}/trunc/model.safetensors",
                                                                             "truncated"]),
    ("serve-pickle-only", ["serve", f"{W}/pickle_bin", "--device", "cpu"], ["{w}/pickle_bin/pytorch_model.bin",
                                                                            PICKLE]),
    ("serve-model-and-preset", ["serve", f"{W}/byte", "--preset", "tiny", "--device", "cpu"],
     ["a model directory or --preset, not both"]),
    ("serve-neither-model-nor-preset", ["serve", "--device", "cpu"], ["give a model directory or --preset NAME (random weights"]),
    # ------------------------------------------------------------ download
    ("download-occupied-dst", ["download", f"{W}/occupied"], ["{w}/occupied", "already exists"]),
    ("download-dst-is-file", ["download", f"{W}/afile"], ["{w}/afile", "already exists"]),
    # ----------------------------------------------------- extract-adapter
    ("extract-missing-trained", ["extract-adapter", f"{W}/nope", f"{W}/byte", f"{W}/cwd/ad"],
     ["{w}/nope", "not a model directory"]),
    ("extract-truncated-base", ["extract-adapter", f"{W}/byte", f"{W}/trunc", f"{W}/cwd/ad"],
     ["{w}/trunc/model.safetensors", "truncated"]),
    ("extract-other-shape", ["extract-adapter", f"{W}/byte", f"{W}/vocab320", f"{W}/cwd/ad"],
     ["differ in their tensors"]),
    ("extract-unchanged", ["extract-adapter", f"{W}/byte", f"{W}/byte", f"{W}/cwd/ad"], ["equals its base"]),
    # ------------------------------------------------------------- convert
    ("convert-missing-src", conv("nope"), ["{w}/nope", "does not exist"]),
    ("convert-src-no-config", conv("nodata"), ["{w}/nodata", "no config.json"]),
    ("convert-config-bad-json", conv("llama_cfg_json"), ["{w}/llama_cfg_json/config.json", "not valid JSON"]),
    ("convert-config-negative-size", conv("llama_cfg_neg"), ["{w}/llama_cfg_neg/config.json", "hidden_size"]),
    ("convert-config-heads-0", conv("llama_cfg_heads0"), ["{w}/llama_cfg_heads0/config.json", "num_attention_heads",
                                                           "positive integer"]),
    ("convert-config-heads-vs-hidden", conv("llama_cfg_heads"), ["{w}/llama_cfg_heads/config.json",
                                                                  "multiple of num_attention_heads=5"]),
    ("convert-config-missing-key", conv("llama_cfg_novocab"), ["{w}/llama_cfg_novocab/config.json",
                                                                "lacks 'vocab_size'"]),
    ("convert-unsupported-arch", conv("llama_gpt2"), ["{w}/llama_gpt2/config.json", "unsupported architecture"]),
    ("convert-truncated-shard", conv("llama_trunc"), ["{w}/llama_trunc/model-", "truncated"]),
    ("convert-missing-shard", conv("llama_missing_shard"), ["{w}/llama_missing_shard", "missing shard"]),
    ("convert-pickle-only", conv("llama_pickle"), ["{w}/llama_pickle/pytorch_model.bin", PICKLE]),
    ("convert-missing-tokenizer", conv("llama_notok"), ["{w}/llama_notok", "no tokenizer files"]),
    ("convert-occupied-dst", conv("llama", dst="occupied"), ["{w}/occupied", "already exists"]),
    ("convert-dst-is-file", conv("llama", dst="afile"), ["{w}/afile", "already exists"]),
    ("convert-bad-shard-size", conv("llama", "--max-shard-size", "lots"), ["bad size 'lots'"]),
    # ------------------------------------------------------------- distill
    ("distill-no-teacher", ["distill", *train()[1:], "--model.init_from", f"{W}/byte"], ["needs a teacher"]),
    ("distill-missing-teacher", ["distill", *train()[1:], "--model.init_from", f"{W}/byte",
                                 "--distill.teacher", f"{W}/nope"], ["{w}/nope", "does not exist"]),
    ("distill-teacher-other-vocab", ["distill", *train()[1:], "--model.init_from", f"{W}/byte",
                                     "--distill.teacher", f"{W}/vocab320"], ["vocabulary", "320"]),
    ("distill-light-without-init", ["distill", *train()[1:], "--model.trainable", "lora+so",
                                    "--distill.teacher", f"{W}/byte"], ["model.trainable", "model.init_from"]),
    # --------------------------------------------------------------- train
    ("train-missing-config", ["train", f"{W}/nope.yaml"], ["{w}/nope.yaml", "does not exist"]),
    ("train-config-bad-yaml", ["train", f"{W}/bad.yaml"], ["{w}/bad.yaml", "not valid YAML"]),
    ("train-config-bad-value", ["train", f"{W}/badvals.yaml"], ["train.steps", ">= 1"]),
    ("train-config-unknown-key", ["train", f"{W}/unknown.yaml"], ["{w}/unknown.yaml", "unknown config key",
                                                                  "train.stepz"]),
    ("train-steps-negative", train("--train.steps", "-3"), ["train.steps", ">= 1"]),
    ("train-model-negative-size", train("--model.overrides", "{hidden_size: -64}"), ["hidden_size",
                                                                                     "positive integer"]),
    ("train-model-window-0", train("--model.window_size", "0"), ["window_size", ">= 1"]),
    ("train-model-kv-heads", train("--model.overrides", "{num_key_value_heads: 3}"), ["num_key_value_heads",
                                                                                      "must divide"]),
    ("train-model-unknown-field", train("--model.overrides", "{num_hiden_layers: 3}"), ["model.overrides",
                                                                                        "num_hiden_layers"]),
    ("train-occupied-out-dir", train(out="run_prev"), ["{w}/run_prev", "already holds a training run", "--resume"]),
    ("train-out-dir-is-file", train(out="afile"), ["{w}/afile", "out_dir is a file"]),
    ("train-binary-corpus", train("--data.train", f"{W}/binary.txt"), ["{w}/binary.txt", "not UTF-8 text"]),
    ("train-nul-corpus", train("--data.train", f"{W}/nul.txt"), ["{w}/nul.txt", "NUL bytes"]),
    ("train-empty-corpus", train("--data.train", f"{W}/empty.txt"), ["{w}/empty.txt", "is empty"]),
    ("train-blank-corpus", train("--data.train", f"{W}/blank.txt"), ["{w}/blank.txt", "is empty"]),
    ("train-non-utf8-jsonl", train("--data.train", f"{W}/latin1.jsonl"), ["{w}/latin1.jsonl", "not UTF-8"]),
    ("train-empty-jsonl", train("--data.train", f"{W}/empty.jsonl"), ["{w}/empty.jsonl", "is empty"]),
    ("train-corpus-dir-without-text", train("--data.train", f"{W}/nodata"), ["{w}/nodata", "holds no files"]),
    ("train-missing-corpus", train("--data.train", f"{W}/nope.txt"), ["{w}/nope.txt", "does not exist"]),
    ("train-tokenizer-dir-without-files", train("--data.tokenizer", f"{W}/byte"), ["{w}/byte",
                                                                                   "without tokenizer files"]),
    ("train-init-from-truncated", train("--model.init_from", f"{W}/trunc"), ["{w}/trunc/model.safetensors",
                                                                             "truncated"]),
    ("train-init-from-pickle", train("--model.init_from", f"{W}/pickle_bin"), ["{w}/pickle_bin/pytorch_model.bin",
                                                                               PICKLE]),
    ("train-init-from-bad-config", train("--model.init_from", f"{W}/cfg_neg"), ["{w}/cfg_neg/config.json",
                                                                                "hidden_size"]),
    ("train-init-from-missing", train("--model.init_from", f"{W}/nope"), ["{w}/nope", "not a model directory"]),
    ("train-resume-pickle-state", train("--resume", out="run_pickle"),
     ["{w}/run_pickle/checkpoints/step_00000002/train_state.pt", "pickle-format training state", "init_from"]),
    ("train-resume-damaged-state", train("--resume", f"{W}/ckpt_bad_state", out="run_prev"),
     ["{w}/ckpt_bad_state/train_state.json", "not valid JSON"]),
    ("train-resume-nothing", train("--resume"), ["no checkpoint under"]),
    # ---------------------------------------------------------------- eval
    ("eval-missing-model", ev("nope"), ["{w}/nope", "not a model directory"]),
    ("eval-truncated-weights", ev("trunc"), ["{w}/trunc/model.safetensors", "truncated"]),
    ("eval-pickle-only", ev("pickle_bin"), ["{w}/pickle_bin/pytorch_model.bin", PICKLE]),
    ("eval-config-window-0", ev("cfg_window0"), ["{w}/cfg_window0/config.json", "window_size"]),
    ("eval-missing-tokenizer", ev("notok"), ["{w}/notok", "no tokenizer files"]),
    ("eval-binary-ppl-data", ev("byte", "--task", "ppl", "--ppl-data", f"{W}/binary.txt"),
     ["{w}/binary.txt", "not UTF-8 text"]),
    ("eval-empty-ppl-data", ev("byte", "--task", "ppl", "--ppl-data", f"{W}/empty.txt"),
     ["{w}/empty.txt", "is empty"]),
    ("eval-depth-above-1", ev("byte", "--task", "passkey", "--passkey-depths", "1.5"), ["--passkey-depths",
                                                                                        "[0, 1]"]),
    ("eval-unknown-task", ev("byte", "--task", "mmlu"), ["--task", "mmlu"]),
    ("eval-out-is-file", ev("byte", "--out", f"{W}/afile"), ["{w}/afile", "--out must be a directory"]),
    # -------------------------------------------------------- eval-harness
    ("harness-missing-model", harness("nope"), ["{w}/nope", "not a model directory"]),
    ("harness-truncated-weights", harness("trunc"), ["{w}/trunc/model.safetensors", "truncated"]),
    ("harness-pickle-only", harness("pickle_bin"), ["{w}/pickle_bin/pytorch_model.bin", PICKLE]),
    ("harness-config-bad-json", harness("cfg_json"), ["{w}/cfg_json/config.json", "not valid JSON"]),
    ("harness-missing-tokenizer", harness("byte"), ["{w}/byte", "no tokenizer files"]),
    ("harness-damaged-tokenizer", harness("badtok"), ["{w}/badtok/tokenizer.json", "not valid JSON"]),
    ("harness-no-tasks", harness("bpe", "--tasks", " , "), ["--tasks names no task"]),
    ("harness-bad-batch-size", harness("bpe", "--batch-size", "lots"), ["--batch-size", "'lots'"]),
    ("harness-negative-limit", harness("bpe", "--limit", "-1"), ["--limit", "> 0"]),
    ("harness-output-is-dir", harness("bpe", "--output", f"{W}/occupied"), ["{w}/occupied", "names a directory"]),
    # --------------------------------------------------------------- bench
    ("bench-from-json-damaged", ["bench", "prefill", "--from-json", f"{W}/bench_bad.json"],
     ["{w}/bench_bad.json", "not valid JSON"]),
    ("bench-from-json-not-a-result", ["bench", "decode", "--from-json", f"{W}/bench_wrong.json"],
     ["{w}/bench_wrong.json", "not a saved `orthros bench decode` result"]),
    ("bench-from-json-other-bench", ["bench", "prefill", "--from-json", f"{W}/bench_decode.json"],
     ["{w}/bench_decode.json", "orthros bench decode", "not of `orthros bench prefill`"]),
    ("bench-from-json-missing", ["bench", "e2e", "--from-json", f"{W}/nope.json"], ["{w}/nope.json", "no such file"]),
    ("bench-checkpoint-truncated", ["bench", "e2e", "--agreement", "--checkpoint", f"{W}/trunc", "--model", "tiny",
                                    "--settings", "64/4", "--device", "cpu", "--no-compile", "--dtype", "fp32"],
     ["{w}/trunc/model.safetensors", "truncated"]),
    ("bench-checkpoint-pickle", ["bench", "e2e", "--agreement", "--checkpoint", f"{W}/pickle_pt", "--model", "tiny",
                                 "--settings", "64/4", "--device", "cpu", "--no-compile", "--dtype", "fp32"],
     ["{w}/pickle_pt/model.pt", PICKLE]),
    ("bench-out-dir-is-file", ["bench", "prefill", "--models", "tiny", "--out-dir", f"{W}/afile"],
     ["{w}/afile", "--out-dir must be a directory"]),
    ("bench-bad-device", ["bench", "decode", "--model", "tiny", "--device", "tpu0"], ["--device", "not a device"]),
    # ---------------------------------------------------------- experiment
    ("experiment-unknown-preset", ["experiment", "recall", "--preset", "huge", "--device", "cpu"],
     ["unknown preset 'huge'"]),
    ("experiment-unknown-arch", ["experiment", "recall", "--archs", "mamba", "--device", "cpu"], ["mamba"]),
    ("experiment-out-is-file", ["experiment", "recall", "--out", f"{W}/afile", "--device", "cpu"],
     ["{w}/afile", "--out must be a directory"]),
    # ---------------------------------------------------------------- demo
    ("demo-fact-depth-past-the-end", ["demo", "--fact-depths", "0.5", "1.5"], ["--fact-depths", "[0, 1]"]),
    ("demo-out-is-file", ["demo", "--out", f"{W}/afile"], ["{w}/afile", "--out must be a directory"]),
    ("demo-not-an-adapter", ["demo", "--adapter", f"{W}/nodata"], ["{w}/nodata", "not an adapter directory"]),
    ("demo-recall-mqar-length-too-short", ["demo", "--recall", "--mqar-lengths", "8"], ["--mqar-lengths 8", "seq_len"]),
    ("demo-recall-out-is-file", ["demo", "--recall", "--out", f"{W}/afile"], ["{w}/afile", "--out must be a directory"]),
]

# a count a flag takes, below its least: the parser's error (errors.count_arg), the line after its usage
COUNT_CASES = [
    ("gen-max-new-tokens-negative", gen("byte", "--max-new-tokens", "-1"),
     "orthros generate: error: argument --max-new-tokens: must be >= 0, got -1"),
    ("gen-top-k-0", gen("byte", "--top-k", "0"), "orthros generate: error: argument --top-k: must be >= 1, got 0"),
    ("gen-temperature-negative", gen("byte", "--temperature", "-0.5"),
     "orthros generate: error: argument --temperature: must be >= 0, got -0.5"),
    ("gen-top-p-above-1", gen("byte", "--top-p", "1.5"),
     "orthros generate: error: argument --top-p: must be > 0 and <= 1, got 1.5"),
    ("gen-top-p-0", gen("byte", "--top-p", "0"),
     "orthros generate: error: argument --top-p: must be > 0 and <= 1, got 0"),
    ("gen-chunk-0", gen("byte", "--prefill-chunk-size", "0"),
     "orthros generate: error: argument --prefill-chunk-size: must be >= 1, got 0"),
    ("eval-batch-size-0", ev("byte", "--batch-size", "0"),
     "orthros eval: error: argument --batch-size: must be >= 1, got 0"),
    ("eval-length-0", ev("byte", "--mqar-lengths", "64", "0"),
     "orthros eval: error: argument --mqar-lengths: must be >= 1, got 0"),
    ("eval-ppl-seq-len-1", ev("byte", "--task", "ppl", "--ppl-seq-len", "1"),
     "orthros eval: error: argument --ppl-seq-len: must be >= 2, got 1"),
    ("harness-negative-fewshot", harness("bpe", "--num-fewshot", "-1"),
     "orthros eval-harness: error: argument --num-fewshot: must be >= 0, got -1"),
    ("bench-window-0", ["bench", "prefill", "--models", "tiny", "--window", "0", "--device", "cpu"],
     "orthros bench prefill: error: argument --window: must be >= 1, got 0"),
    ("bench-length-0", ["bench", "prefill", "--models", "tiny", "--lengths", "8K", "0", "--device", "cpu"],
     "orthros bench prefill: error: argument --lengths: must be >= 1, got 0"),
    ("bench-layers-0", ["bench", "decode", "--model", "tiny", "--layers", "0", "--device", "cpu"],
     "orthros bench decode: error: argument --layers: must be >= 1, got 0"),
    ("bench-train-window-0", ["bench", "train", "--window", "0", "--device", "cpu"],
     "orthros bench train: error: argument --window: must be >= 1, got 0"),
    ("bench-timed-steps-1", ["bench", "e2e", "--model", "tiny", "--max-timed-steps", "1", "--device", "cpu"],
     "orthros bench e2e: error: argument --max-timed-steps: must be >= 2, got 1"),
    ("experiment-steps-0", ["experiment", "recall", "--steps", "0", "--device", "cpu"],
     "orthros experiment: error: argument --steps: must be >= 1, got 0"),
    ("experiment-jobs-0", ["experiment", "recall", "--jobs", "0", "--device", "cpu"],
     "orthros experiment: error: argument --jobs: must be >= 1, got 0"),
    # cpt trained arms for 0 steps and reported them; --jobs 0 was said after the rows were prepared
    ("experiment-cpt-steps-0", ["experiment", "cpt", "--steps", "160", "0", "--arms", "source", "--device", "cpu"],
     "orthros experiment: error: argument --steps: must be >= 1, got 0"),
    ("experiment-cpt-jobs-0", ["experiment", "cpt", "--jobs", "0", "--arms", "source", "--device", "cpu"],
     "orthros experiment: error: argument --jobs: must be >= 1, got 0"),
    ("demo-window-0", ["demo", "--window", "0"], "orthros demo: error: argument --window: must be >= 1, got 0"),
    ("demo-max-new-tokens-negative", ["demo", "--max-new-tokens", "-1"],
     "orthros demo: error: argument --max-new-tokens: must be >= 0, got -1"),
    ("extract-rank-0", ["extract-adapter", f"{W}/byte", f"{W}/sharded", f"{W}/cwd/ad", "--rank", "0"],
     "orthros extract-adapter: error: argument --rank: must be >= 1, got 0"),
    ("convert-window-0", conv("llama", "--window-size", "0"),
     "orthros convert: error: argument --window-size: must be >= 1, got 0"),
    ("convert-sink-tokens-negative", conv("llama", "--sink-tokens", "-1"),
     "orthros convert: error: argument --sink-tokens: must be >= 0, got -1"),
    ("eval-mqar-vocab-0", ev("byte", "--mqar-vocab", "0"),
     "orthros eval: error: argument --mqar-vocab: must be >= 4, got 0"),
    ("demo-sink-tokens-negative", ["demo", "--sink-tokens", "-1"],
     "orthros demo: error: argument --sink-tokens: must be >= 0, got -1"),
    ("demo-recall-window-0", ["demo", "--recall", "--window", "0"],
     "orthros demo: error: argument --window: must be >= 1, got 0"),
    ("demo-recall-max-new-tokens-negative", ["demo", "--recall", "--max-new-tokens", "-1"],
     "orthros demo: error: argument --max-new-tokens: must be >= 0, got -1"),
    ("demo-recall-seq-len-16", ["demo", "--recall", "--seq-len", "16"],
     "orthros demo: error: argument --seq-len: must be >= 32, got 16"),
]


def _one_error_line(err: str) -> list[str]:
    """stderr's lines, less transformers' weight-loading progress bar (drawn with carriage returns
    where the weights are read, e.g. before the NaN check)."""
    return [line for line in err.replace("\r", "\n").splitlines()
            if line.strip() and not line.startswith("Loading weights")]


@pytest.mark.parametrize("argv, expect", [pytest.param(a, e, id=i) for i, a, e in CASES])
def test_bad_input_is_one_clear_line(world, argv, expect, capfd, monkeypatch):
    monkeypatch.chdir(world / "cwd")
    monkeypatch.delenv("ORTHROS_DEBUG", raising=False)
    argv = [a.replace(W, str(world)) for a in argv]
    before = tree_digest(world)
    capfd.readouterr()
    rc = main(argv)
    out, err = capfd.readouterr()
    lines = _one_error_line(err)
    assert rc == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith(f"orthros {argv[0]}: error: "), err
    for e in expect:
        assert e.replace("{w}", str(world)) in lines[0], f"{e!r} not in {lines[0]!r}"
    assert out == ""
    assert not (world / MARKER).exists(), "a pickle was unpickled"
    assert tree_digest(world) == before, "a failed command changed its inputs or left files behind"


# a flag the command does not take, or a value that is not what the flag takes: the command's own parser
# says so (it was the top-level parser's `orthros: error:` for a flag given to a subcommand)
FLAG_CASES = [
    ("generate-unknown-flag", gen("byte", "--model", "x"),
     "orthros generate: error: unrecognized arguments: --model x"),
    ("bench-unknown-flag", ["bench", "decode", "--foo", "--device", "cpu"],
     "orthros bench decode: error: unrecognized arguments: --foo"),
    # an amount (seconds, a rate, a bandwidth) must be a finite number > 0: --peak-tflops 0 divided by zero,
    # --bandwidth -1 printed negative rooflines
    ("bench-peak-tflops-0", ["bench", "train", "--peak-tflops", "0", "--device", "cpu"],
     "orthros bench train: error: argument --peak-tflops: must be > 0, got 0"),
    ("bench-bandwidth-negative", ["bench", "decode", "--bandwidth", "-1", "--device", "cpu"],
     "orthros bench decode: error: argument --bandwidth: must be > 0, got -1"),
    ("serve-kv-gib-negative", ["serve", "--preset", "tiny", "--kv-cache-gib", "-1", "--device", "cpu"],
     "orthros serve: error: argument --kv-cache-gib: must be > 0, got -1"),
    ("demo-seconds-0", ["demo", "--recall", "--seconds", "0"],
     "orthros demo: error: argument --seconds: must be > 0, got 0"),
    ("demo-lr-nan", ["demo", "--recall", "--lr", "nan"], "orthros demo: error: argument --lr: must be > 0, got nan"),
    ("experiment-seconds-not-a-number", ["experiment", "recall", "--seconds", "soon", "--device", "cpu"],
     "orthros experiment: error: argument --seconds: a number, not 'soon'"),
    ("bench-length-not-a-length", ["bench", "prefill", "--lengths", "abc", "--device", "cpu"],
     "orthros bench prefill: error: argument --lengths: not a length: 'abc' (use e.g. 8192, 32K, 1M)"),
]


@pytest.mark.parametrize("argv, said", [pytest.param(a, e, id=i) for i, a, e in COUNT_CASES + FLAG_CASES])
def test_a_bad_flag_or_count_is_the_commands_parser_error(world, argv, said, capfd, monkeypatch):
    """argparse's usage and one line naming the flag, exit code 2 (SystemExit), before anything is
    read, run or written."""
    monkeypatch.chdir(world / "cwd")
    monkeypatch.delenv("ORTHROS_DEBUG", raising=False)
    argv = [a.replace(W, str(world)) for a in argv]
    before = tree_digest(world)
    capfd.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capfd.readouterr()
    lines = err.splitlines()
    assert e.value.code == 2, err
    assert lines[0].startswith("usage: ") and lines[-1] == said, err
    assert "Traceback" not in err and out == ""
    assert tree_digest(world) == before, "a refused command changed its inputs or left files behind"


def test_every_subcommand_is_swept():
    from orthros.cli import COMMANDS

    swept = {argv[0] for _, argv, _ in CASES}
    assert swept == set(COMMANDS)


def test_debug_shows_the_traceback(world, monkeypatch):
    """ORTHROS_DEBUG=1 (or --debug) re-raises a user error for developers."""
    argv = ["generate", str(world / "trunc"), "--prompt", "x", "--device", "cpu"]
    with pytest.raises(ValueError, match="truncated"):
        main(["--debug", *argv])
    monkeypatch.setenv("ORTHROS_DEBUG", "1")
    with pytest.raises(ValueError, match="truncated"):
        main(argv)


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only user mistakes become one line: an internal error propagates."""
    import orthros.generate_cli as g

    def broken(args):
        raise IndexError("a bug")

    monkeypatch.setattr(g, "check_args", broken)
    with pytest.raises(IndexError):
        main(["generate", "x", "--prompt", "y"])


def test_entry_point_prints_one_line(world):
    """The command itself, in a fresh interpreter: the truncated model.safetensors that used to end in
    a SafetensorError traceback ("incomplete metadata")."""
    env = {k: v for k, v in os.environ.items() if k != "ORTHROS_DEBUG"}
    r = subprocess.run([sys.executable, "-m", "orthros", "generate", str(world / "trunc"), "--prompt", "hi",
                        "--device", "cpu"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()  # (a library's deprecation warning may come first)
    assert [line for line in lines if line.startswith("orthros")] == lines[-1:], r.stderr
    assert lines[-1].startswith(f"orthros generate: error: {world / 'trunc/model.safetensors'}: truncated (")
