"""`serve --engine-arg`: the engine flags that pass through (runtime LoRA, the parsers) and the ones refused."""
from __future__ import annotations

import pytest

from tgi_hpc.errors import UsageError
from tgi_hpc.workflows.engine_flags import engine_args


def test_runtime_lora_and_the_parsers_pass_through():
    assert engine_args(["--enable-runtime-lora", "--max-loras=2", "--max-lora-rank=32",
                        "--tool-call-parser=deepseek_v3", "--reasoning-parser=gpt_oss"]) == [
        "--enable-runtime-lora", "--max-loras", "2", "--max-lora-rank", "32", "--tool-call-parser", "deepseek_v3",
        "--reasoning-parser", "gpt_oss"]


@pytest.mark.parametrize("item, message", [
    ("--api-key=secret", "set by tgi-hpc itself"),
    ("--enable-runtime-lora=yes", "is not an engine flag"),
    ("--max-loras", "is not an engine flag"),
    ("--quantize=fp8", "use `tgi-hpc serve --quantize`"),
    ("--rm-rf=/", "is not an engine flag"),
])
def test_refused_with_the_reason(item, message):
    with pytest.raises(UsageError, match=message):
        engine_args([item])
