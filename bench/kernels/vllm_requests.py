"""Send a mixed batch of completions to a running vLLM (token-id prompts) and print a summary.

    python3 -m bench.kernels.vllm_requests --port 8000 --out $OUT/vllm_requests.json

Prompts of 17 to 3000 tokens arrive together, so the engine runs prefills, chunked prefills and
decodes of many sequences in the same steps: every path of the attention backend is exercised.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

PROMPT_LENS = [17, 40, 100, 217, 217, 500, 1000, 1500, 2200, 3000, 64, 333]


def complete(port: int, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = json.dumps(
        {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    t0 = time.time()
    with urllib.request.urlopen(request, timeout=300) as response:
        reply = json.loads(response.read())
    return {
        "prompt_tokens": reply["usage"]["prompt_tokens"],
        "completion_tokens": reply["usage"]["completion_tokens"],
        "seconds": time.time() - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", default="vllm_requests.json")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 150000) for _ in range(n)] for n in PROMPT_LENS]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: complete(args.port, p, args.max_tokens), prompts))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    done = sum(r["completion_tokens"] == args.max_tokens for r in results)
    print(f"requests={len(results)} complete={done} tokens_out={sum(r['completion_tokens'] for r in results)}")


if __name__ == "__main__":
    main()
