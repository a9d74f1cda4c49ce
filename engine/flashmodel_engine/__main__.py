"""Entry point: `python -m flashmodel_engine launch|preflight|prewarm|bake-modelinfos`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from flashmodel_engine.config import ConfigError, EngineConfig, load_config
from flashmodel_engine.contract import CONFIG_FILE, PREFLIGHT_EXIT_CODE
from flashmodel_engine.launcher import write_termination_message

log = logging.getLogger("flashmodel")


def _setup_logging() -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="ts=%(asctime)s level=%(levelname)s component=%(name)s %(message)s")


def _config(path: str) -> EngineConfig:
    try:
        return load_config(path)
    except ConfigError as e:
        log.error("event=config-invalid reason=%r", str(e))
        write_termination_message(str(e))
        raise SystemExit(PREFLIGHT_EXIT_CODE) from e


def cmd_launch(args: argparse.Namespace) -> int:
    from flashmodel_engine.launcher import launch
    from flashmodel_engine.profiles import ProfileError

    config = _config(args.config)
    try:
        return asyncio.run(launch(config, prewarm_on_start=args.prewarm_on_start))
    except ProfileError as e:
        log.error("event=config-refused reason=%r", str(e))
        write_termination_message(str(e))
        return PREFLIGHT_EXIT_CODE


def cmd_preflight(args: argparse.Namespace) -> int:
    from flashmodel_engine.preflight import format_report, run_preflight

    config = _config(args.config)
    report = run_preflight(config, args.model_dir)
    for line in format_report(report):
        print(line)
    if not report.ok:
        write_termination_message("preflight failed: " + " | ".join(report.failures))
    return 0 if report.ok else 1


def cmd_prewarm(args: argparse.Namespace) -> int:
    from flashmodel_engine.prewarm import run_prewarm

    config = load_config(args.config) if args.config else None
    p = config.prewarm if config else None
    headers = {}
    key_file = args.api_key_file or (config.auth.api_key_file if config and config.auth else None)
    if key_file:
        headers["Authorization"] = f"Bearer {Path(key_file).read_text().strip()}"
    model = args.model or (config.model.served_name if config else None)
    if model is None:
        print("prewarm: pass --model NAME or --config FILE (the served model name is needed)", file=sys.stderr)
        return 2
    result = asyncio.run(run_prewarm(
        args.url.rstrip("/"), model, requests=args.requests or (p.requests if p else 5),
        prompts=list(p.prompts) if p else [], max_tokens=args.max_tokens or (p.max_tokens if p else 16),
        timeout_seconds=args.timeout or (p.timeout_seconds if p else 120), max_model_len=args.max_model_len,
        headers=headers))
    print(json.dumps(result.to_json()))
    return 0 if result.ok else 1


def cmd_bake_modelinfos(args: argparse.Namespace) -> int:
    from flashmodel_engine.modelinfos import bake_modelinfos

    try:
        written = bake_modelinfos(args.architectures, Path(args.into))
    except ValueError as e:
        print(f"bake-modelinfos: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0 if written else 1


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    parser = argparse.ArgumentParser(prog="flashmodel_engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("launch", help="preflight, then run vLLM and the health shim")
    p.add_argument("--config", default=CONFIG_FILE)
    p.add_argument("--no-prewarm-on-start", dest="prewarm_on_start", action="store_false",
                   help="leave prewarm to POST /prewarm (the operator's call) instead of running it at start")
    p.set_defaults(func=cmd_launch)
    p = sub.add_parser("preflight", help="check model files and settings without starting vLLM")
    p.add_argument("--config", default=CONFIG_FILE)
    p.add_argument("--model-dir", default=None, help="model directory (default: model.path of the config)")
    p.set_defaults(func=cmd_preflight)
    p = sub.add_parser("prewarm", help="run prewarm against a vLLM OpenAI server and print the result JSON")
    p.add_argument("--url", required=True, help="vLLM's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--config", default=None, help="engine config for prompts, max tokens, model name, key")
    p.add_argument("--model", default=None, help="served model name (default: from --config)")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--api-key-file", default=None)
    p.set_defaults(func=cmd_prewarm)
    p = sub.add_parser("bake-modelinfos",
                       help="at image build: cache vLLM's model-class inspection, for the launcher to seed")
    p.add_argument("--into", default="/opt/flashmodel/vllm-modelinfos")
    p.add_argument("architectures", nargs="+", help="vLLM architecture names, e.g. Qwen2ForCausalLM")
    p.set_defaults(func=cmd_bake_modelinfos)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
