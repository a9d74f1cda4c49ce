"""The vLLM flags extraArgs may set (an allow-list), and the flags no cluster setting may allow.

An extra arg is refused unless the option vLLM resolves it to (vllm_flags.resolve: prefixes, `=`, `_`)
is on ALLOWED_FLAGS, on the cluster admin's extension (the chart's `engineExtraArgs.allowed`, which
the operator passes in the engine config as `engine.extraArgsAllowed`), or a flag ENFORCED_WHEN_SET
leaves to extraArgs. Each entry is an option string, so `--no-foo` is judged on its own, not as
`--foo`. Flags that read files or URLs, load code, change memory, devices, ports, hosts, auth or the
model and tokenizer source are left out; profiles.NEVER_ALLOWED names those no extension may add.
"""

from __future__ import annotations

ALLOWED_FLAGS: dict[str, str] = {
    # Sampling and responses: what one request gets back, nothing the pod holds.
    "--seed": "the sampling seed; reproducibility only",
    "--response-role": "the role name of chat completions' answers",
    "--return-tokens-as-token-ids": "token ids in logprobs instead of text",
    "--no-return-tokens-as-token-ids": "vLLM's default",
    "--enable-prompt-tokens-details": "usage.prompt_tokens_details in responses",
    "--no-enable-prompt-tokens-details": "vLLM's default",
    "--enable-force-include-usage": "usage in every streamed response",
    "--no-enable-force-include-usage": "vLLM's default",
    "--override-generation-config": "default sampling parameters (JSON), as a request could set them",
    "--stream-interval": "tokens per streamed chunk",
    # Chat, tools and reasoning: parsers built into vLLM, chosen by name (their *-plugin flags load files).
    "--tool-call-parser": "one of vLLM's built-in tool-call parsers, by name",
    "--enable-auto-tool-choice": "lets the model pick tools (needs --tool-call-parser)",
    "--no-enable-auto-tool-choice": "vLLM's default",
    "--exclude-tools-when-tool-choice-none": "leaves tools out of the prompt for tool_choice none",
    "--no-exclude-tools-when-tool-choice-none": "vLLM's default",
    "--reasoning-parser": "one of vLLM's built-in reasoning parsers, by name",
    "--chat-template-content-format": "how message content is passed to the model's own chat template",
    "--default-chat-template-kwargs": "default arguments (JSON) of the model's own chat template",
    # The API server's surface and its logs (to the container's stdout).
    "--enable-server-load-tracking": "the /load endpoint's in-flight request count",
    "--no-enable-server-load-tracking": "vLLM's default",
    "--enable-request-id-headers": "X-Request-Id on responses",
    "--no-enable-request-id-headers": "vLLM's default",
    "--enable-tokenizer-info-endpoint": "the /tokenizer_info endpoint (the model's own tokenizer config)",
    "--no-enable-tokenizer-info-endpoint": "vLLM's default",
    "--disable-fastapi-docs": "no /docs, /redoc or /openapi.json",
    "--no-disable-fastapi-docs": "vLLM's default",
    "--enable-log-requests": "logs each request to stdout",
    "--no-enable-log-requests": "vLLM's default",
    "--enable-log-outputs": "logs each output to stdout (with --enable-log-requests)",
    "--no-enable-log-outputs": "vLLM's default",
    "--max-log-len": "truncates logged prompts",
    "--uvicorn-log-level": "the HTTP server's log level",
    "--disable-uvicorn-access-log": "no access log lines",
    "--no-disable-uvicorn-access-log": "vLLM's default",
    "--disable-access-log-for-endpoints": "no access log lines for the paths named (e.g. /health)",
    "--log-error-stack": "logs the stack of request errors",
    "--no-log-error-stack": "vLLM's default",
    "--use-tqdm-on-load": "the weight-loading progress bar",
    "--no-use-tqdm-on-load": "no progress bar",
    # Scheduling within the profile's budgets (maxNumSeqs, maxNumBatchedTokens): order and chunking only.
    "--enable-chunked-prefill": "splits long prompts into steps within maxNumBatchedTokens",
    "--no-enable-chunked-prefill": "whole prompts only; maxNumBatchedTokens must then be >= maxModelLen",
    "--scheduling-policy": "fcfs or priority order of waiting requests",
    "--long-prefill-token-threshold": "a prompt longer than this counts as long for the chunked-prefill scheduler",
}
"""Option string -> why it is safe under the profile: memory, devices and sources stay the profile's.

Not here though they look harmless: --max-logprobs (vLLM's memory profile samples without logprobs,
so a raised cap lets a request's prompt logprobs take GPU memory outside gpuMemoryUtilization) and
--logprobs-mode (its processed modes keep another copy of the logits).
"""
