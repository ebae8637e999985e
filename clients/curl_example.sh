#!/usr/bin/env sh
# Talk to the specd gateway with curl: one plain and one streamed chat completion.
# Usage: clients/curl_example.sh [BASE_URL]   (default $SPECD_GATEWAY_URL or http://127.0.0.1:8000/v1)
# With API keys enabled, export SPECD_API_KEY.
set -eu
URL="${1:-${SPECD_GATEWAY_URL:-http://127.0.0.1:8000/v1}}"
AUTH="Authorization: Bearer ${SPECD_API_KEY:-none}"

# Non-streaming: the answer, `usage` and `spec_stats` (drafted, accepted, MAT, ...) in one JSON.
curl -sS "$URL/chat/completions" -H "Content-Type: application/json" -H "$AUTH" -d '{
  "model": "specd",
  "messages": [{"role": "user", "content": "Name three primary colours."}],
  "max_tokens": 64, "temperature": 0,
  "speculative": {"policy": "svip", "params": {"h": 0.4}}
}'
echo

# Streaming (-N: no buffering): Server-Sent Events `data: {chunk}` lines; the chunk with the
# finish_reason carries spec_stats, then a usage chunk, then `data: [DONE]`.
curl -sSN "$URL/chat/completions" -H "Content-Type: application/json" -H "$AUTH" -d '{
  "model": "specd",
  "messages": [{"role": "user", "content": "Count from one to five."}],
  "max_tokens": 64, "temperature": 0, "stream": true,
  "stream_options": {"include_usage": true}
}'
