"""The extraArgs allow-list: every spelling of a flag off the list is refused, in the operator and in the pod."""

from __future__ import annotations

from typing import Any

import pytest
from flashmodel_engine.config import parse_config
from flashmodel_engine.extra_args_allowed import ALLOWED_FLAGS
from flashmodel_engine.preflight import run_preflight
from flashmodel_engine.profiles import (
    CODE_FLAGS,
    NEVER_ALLOWED,
    SOURCE_FLAGS,
    ProfileError,
    check_extra_args,
    extension_problems,
    used_extension,
    vllm_args,
)
from flashmodel_engine.vllm_flags import dest_of
from flashmodel_engine.vllm_options import TABLES

# Where the check runs: the operator (every stored table) and the pod (one vLLM's table, strictly).
WHERE = [pytest.param(None, False, id="operator"),
         *(pytest.param(table, True, id=f"pod-vllm-{v}") for v, table in TABLES.items())]


def make(**engine: Any) -> Any:
    return parse_config({"accelerator": "t4", "model": {"path": "/models/qwen", "servedName": "qwen"},
                         "engine": engine})


@pytest.mark.parametrize(("args", "flag", "instead"), [
    (["--load-format", "dummy"], "--load-format", "loads the weights spec.model names"),
    (["--load_format=dummy"], "--load-format", "loads the weights spec.model names"),
    (["--load-f", "dummy"], "--load-format", "loads the weights spec.model names"),
    (["--load-form=dummy"], "--load-format", "loads the weights spec.model names"),
    (["--trust-remote-code"], "--trust-remote-code", "set spec.model.trustRemoteCode instead"),
    (["--trust_remote_code"], "--trust-remote-code", "set spec.model.trustRemoteCode instead"),
    (["--no-trust-remote-code"], "--trust-remote-code", "spec.model.trustRemoteCode"),
    (["--tokenizer", "org/x"], "--tokenizer", "the tokenizer comes from the model's own source"),
    (["--tokenizer=org/x"], "--tokenizer", "the tokenizer comes from the model's own source"),
    (["--tokenizer-revision", "main"], "--tokenizer", "at spec.model.hub.revision"),
    (["--download-dir", "/cache"], "--download-dir", "spec.model.hub.cache"),
    (["--model-loader-extra-config", "{}"], "--model-loader-extra-config", "the weights spec.model names"),
    (["--hf-config-path", "/x"], "--hf-config-path", "its own source"),
    (["--hf-token", "hf_x"], "--hf-token", "spec.model.hub.tokenSecretRef"),
    (["--allowed-local-media-path", "/"], "--allowed-local-media-path", "may not read files"),
    (["--middleware", "evil.App"], "--middleware", "loads Python code"),
    (["--tool-parser-plugin", "/models/x.py"], "--tool-parser-plugin", "loads Python code"),
    (["--logits-processors", "a.B"], "--logits-processors", "loads Python code"),
    (["--worker-cls=a.B"], "--worker-cls", "loads Python code"),
])
@pytest.mark.parametrize(("options", "strict"), WHERE)
def test_source_and_code_flags_are_refused_however_spelt(
    args: list[str], flag: str, instead: str, options: Any, strict: bool
) -> None:
    problems = check_extra_args(["--seed", "1", *args], options, strict=strict)
    assert len(problems) == 1, problems
    assert problems[0].startswith("engine.extraArgs[2]") and flag in problems[0] and instead in problems[0]


@pytest.mark.parametrize("args", [
    ["--generation-config", "vllm"], ["--chat-template", "/etc/flashmodel/control/token"],
    ["--enable-prompt-embeds"], ["--enable-sleep-mode"], ["--api-server-count", "2"], ["--model-impl", "vllm"],
    ["--disable-log-stats"], ["--skip-tokenizer-init"], ["--allowed-origins", "[\"*\"]"], ["--ssl-keyfile", "/k"],
    ["--fully-sharded-loras"], ["--tool-server", "demo"], ["--trust-request-chat-template"], ["--headless"],
    ["--max-logprobs", "-1"], ["--logprobs-mode", "processed_logits"],
])
@pytest.mark.parametrize(("options", "strict"), WHERE)
def test_a_flag_off_the_allow_list_is_refused_with_how_to_ask_for_it(
    args: list[str], options: Any, strict: bool
) -> None:
    problems = check_extra_args(args, options, strict=strict)
    assert len(problems) == 1, problems
    assert f"{args[0]} is not on the allow-list of vLLM flags known to be safe under the profile" in problems[0]
    assert "ask the cluster admin to add it to the chart's engineExtraArgs.allowed" in problems[0]


@pytest.mark.parametrize(("options", "strict"), WHERE)
def test_an_abbreviation_of_a_flag_off_the_list_is_refused_in_its_full_name(options: Any, strict: bool) -> None:
    problems = check_extra_args(["--generation-conf=vllm"], options, strict=strict)
    assert len(problems) == 1 and "(vLLM reads --generation-conf as --generation-config)" in problems[0], problems


@pytest.mark.parametrize(("options", "strict"), WHERE)
def test_a_negation_is_judged_on_its_own(options: Any, strict: bool) -> None:
    # --enable-log-requests and its negation are both listed; --disable-fastapi-docs's negation too;
    # --fully-sharded-loras is not, so neither is its negation, though both share one dest.
    assert check_extra_args(["--no-enable-log-requests", "--no-disable-fastapi-docs"], options, strict=strict) == []
    problems = check_extra_args(["--no-fully-sharded-loras"], options, strict=strict)
    assert len(problems) == 1 and "--no-fully-sharded-loras is not on the allow-list" in problems[0], problems


@pytest.mark.parametrize("flag", sorted(ALLOWED_FLAGS))
@pytest.mark.parametrize(("options", "strict"), WHERE)
def test_every_allowed_flag_is_accepted(flag: str, options: Any, strict: bool) -> None:
    table = options or TABLES["0.32.0"]
    nargs = table[flag][1]
    value = {"--default-chat-template-kwargs": "{}", "--override-generation-config": "{}",
             "--uvicorn-log-level": "info", "--scheduling-policy": "priority",
             "--chat-template-content-format": "auto", "--tool-call-parser": "hermes",
             "--reasoning-parser": "deepseek_r1", "--response-role": "assistant",
             "--disable-access-log-for-endpoints": "/health"}.get(flag, "1")
    args = [flag] if nargs == "0" else [flag, value]
    assert check_extra_args(args, options, strict=strict) == []
    # Through the whole profile too (chunked prefill off needs the whole context in one step).
    assert vllm_args(make(extraArgs=args))[: len(args)] == args


def test_every_allowed_flag_is_in_every_stored_table_and_touches_no_guarded_dest() -> None:
    for version, table in TABLES.items():
        missing = [flag for flag in ALLOWED_FLAGS if flag not in table]
        assert missing == [], f"vLLM {version} lacks {missing}: a flag only some versions have is refused anyway"
        guarded = {dest_of(flag, table) for flag in NEVER_ALLOWED}
        assert [flag for flag in ALLOWED_FLAGS if table[flag][0] in guarded] == []
    assert not set(ALLOWED_FLAGS) & set(NEVER_ALLOWED)


@pytest.mark.parametrize(("options", "strict"), WHERE)
def test_the_admins_extension_allows_a_flag(options: Any, strict: bool) -> None:
    args = ["--generation-config", "vllm", "--seed", "1"]
    assert check_extra_args(args, options, strict=strict, extension=["--generation-config"]) == []
    # An extension allows the flag it names, not its abbreviations' other readings or other flags.
    problems = check_extra_args(["--model-impl", "vllm"], options, strict=strict, extension=["--generation-config"])
    assert len(problems) == 1 and "--model-impl is not on the allow-list" in problems[0]
    assert vllm_args(make(extraArgs=args, extraArgsAllowed=["--generation-config"]))[:4] == args


@pytest.mark.parametrize("flag", [
    "--load-format", "--trust-remote-code", "--tokenizer", "--tokenizer-revision", "--gpu-memory-utilization",
    "--device-memory-utilization", "--max-model-len", "--config", "--kv-cache-dtype", "--enable-prefix-caching",
    "--middleware", "--hf-token", "--no-trust-remote-code",
])
def test_the_admin_cannot_allow_a_flag_the_profile_or_the_source_depends_on(flag: str) -> None:
    problems = extension_problems([flag])
    assert len(problems) == 1 and f"{flag} can never be allowed" in problems[0], problems
    # The engine refuses it in the config it reads too, whatever wrote it there.
    with pytest.raises(ProfileError, match=f"engine.extraArgsAllowed: {flag} can never be allowed"):
        vllm_args(make(extraArgsAllowed=[flag]))
    assert set(SOURCE_FLAGS) | set(CODE_FLAGS) <= set(NEVER_ALLOWED)


@pytest.mark.parametrize(("flag", "expect"), [
    ("--generation", "no supported vLLM has this flag"), ("generation-config", "is not a vLLM flag in full"),
    ("--generation-config=vllm", "is not a vLLM flag in full"), ("--no-such-flag", "no supported vLLM has this flag"),
])
def test_an_extension_entry_must_be_a_flag_in_full(flag: str, expect: str) -> None:
    problems = extension_problems([flag])
    assert len(problems) == 1 and expect in problems[0], problems


def test_only_the_extension_entries_a_model_uses_are_passed_on() -> None:
    extension = ["--generation-config", "--model-impl"]
    assert used_extension(["--seed", "1", "--generation-conf=vllm"], extension) == ["--generation-config"]
    assert used_extension(["--seed", "1"], extension) == []


def test_the_launcher_refuses_a_flag_off_the_list_before_vllm_starts() -> None:
    report = run_preflight(make(extraArgs=["--load-format", "dummy"]), detect=False)
    assert any("changes the model's source with --load-format" in f for f in report.failures), report
    report = run_preflight(make(extraArgs=["--generation-config", "vllm"]), detect=False)
    assert any("--generation-config is not on the allow-list" in f for f in report.failures), report


def test_chunked_prefill_counts_only_where_the_last_of_its_flags_turns_it_on() -> None:
    with pytest.raises(ProfileError, match="below maxModelLen"):
        vllm_args(make(maxNumBatchedTokens=1024, extraArgs=["--enable-chunked-prefill", "--no-enable-chunked-prefill"]))
    vllm_args(make(maxNumBatchedTokens=1024, extraArgs=["--no-enable-chunked-prefill", "--enable-chunked-prefill"]))


def test_the_design_doc_lists_every_allowed_and_never_allowed_flag() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    section = doc.split("#### Extra args", 1)[1].split("\n### ", 1)[0]
    words = set(section.replace("`", " ").replace("/", " ").replace(",", " ").replace("(", " ").split())
    missing = [f for f in (*ALLOWED_FLAGS, *SOURCE_FLAGS, *CODE_FLAGS) if f not in words]
    assert missing == [], f"docs/design.md, 'Extra args', does not name {missing}"
