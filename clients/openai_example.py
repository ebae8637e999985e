"""Stream a chat answer from the specd gateway with the official OpenAI SDK.

    python clients/openai_example.py "Why is the sky blue?" [--url http://127.0.0.1:8000/v1]

The gateway speaks OpenAI's API; specd's extras travel in `extra_body` (the `speculative`
settings) and come back in `model_extra` (the `spec_stats` of the final chunk).
"""

from __future__ import annotations

import argparse
import json
import os

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="Give me three facts about the Moon.")
    parser.add_argument("--url", default=os.environ.get("SPECD_GATEWAY_URL", "http://127.0.0.1:8000/v1"))
    parser.add_argument("--policy", default="heuristic", help="stopping policy (none = target alone)")
    args = parser.parse_args()

    # The key is only checked when the gateway was started with API keys.
    client = OpenAI(base_url=args.url, api_key=os.environ.get("SPECD_API_KEY", "none"))
    stream = client.chat.completions.create(
        model="specd",  # the gateway serves one target model whatever the name
        messages=[{"role": "user", "content": args.prompt}],
        max_tokens=200,
        temperature=0,  # greedy: exactly the target model's own answer
        stream=True,
        stream_options={"include_usage": True},  # a last chunk with token counts
        extra_body={"speculative": {"policy": args.policy}},
    )
    stats: dict = {}
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.choices and chunk.choices[0].finish_reason:  # the final chunk carries spec_stats
            stats = (chunk.model_extra or {}).get("spec_stats", {})
        if chunk.usage:
            print(f"\n\nusage: {chunk.usage.model_dump()}")
    keys = ("policy", "drafted", "accepted", "mean_accepted_tokens", "acceptance_rate", "verifications")
    print("spec_stats:", json.dumps({k: stats.get(k) for k in keys}))


if __name__ == "__main__":
    main()
