"""The official openai SDK and requests against Cortex's demo gateway (cargo xtask sdk-check).

Each check raises AssertionError with what it saw; the script exits non-zero on the first.
"""

import argparse
import asyncio
import json
import time

import openai
import requests

VLLM, SGLANG = "qwen3-vllm", "qwen3-sglang"
MODELS = (VLLM, SGLANG)
MESSAGES = [{"role": "user", "content": "Explain KV caches in one sentence."}]
checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


def expect_error(kind, code, call, what):
    try:
        call()
    except kind as e:
        check(e.code == code, f"{what}: code {e.code!r}, wanted {code!r} ({e})")
        return e
    except openai.APIError as e:
        raise AssertionError(f"{what}: raised {type(e).__name__} code={e.code!r}, wanted {kind.__name__}") from e
    raise AssertionError(f"{what}: no error raised")


def chat_and_completions(client):
    for model in MODELS:
        r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8)
        check(r.choices[0].message.content, f"{model} chat: no content")
        check(r.usage and r.usage.prompt_tokens > 0, f"{model} chat: no usage")
        chunks = list(
            client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=8, stream=True, stream_options={"include_usage": True}
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        check(text, f"{model} chat stream: no text")
        check(chunks[-1].usage and chunks[-1].usage.prompt_tokens > 0, f"{model} chat stream: no final usage")
        r = client.completions.create(model=model, prompt="KV caches are", max_tokens=8)
        check(r.choices[0].text, f"{model} completion: no text")
        check(r.usage and r.usage.completion_tokens > 0, f"{model} completion: no usage")
        chunks = list(
            client.completions.create(
                model=model, prompt="KV caches are", max_tokens=8, stream=True, stream_options={"include_usage": True}
            )
        )
        check("".join(c.choices[0].text for c in chunks if c.choices), f"{model} completion stream: no text")
        check(chunks[-1].usage is not None, f"{model} completion stream: no final usage")
    listed = {m.id for m in client.models.list()}
    check(listed == set(MODELS), f"/v1/models lists {listed}")


def tool_calling(client):
    # The follow-up turn of a tool call, built the way SDK users build it: the assistant message
    # as the SDK returns it (content None, arguments a JSON string), then the tool's answer. Sent
    # twice: the second time the gateway must predict the cache hit, which it can only do if it
    # rendered the turn exactly as the engine did.
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Zürich", "unit": "c"})}}
    messages = [
        {"role": "user", "content": "What is the weather in Zürich? Answer after checking the tool, please."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temp": 21.5, "sky": "clear"})},
    ]
    for model in MODELS:
        modes = []
        for _ in range(2):
            raw = client.chat.completions.with_raw_response.create(
                model=model, messages=messages, tools=tools, max_tokens=8
            )
            r = raw.parse()
            check(r.choices[0].message.content, f"{model} tool follow-up: no content")
            modes.append((raw.headers.get("x-cortex-match-mode"), raw.headers.get("x-cortex-cache-hit-tokens")))
            time.sleep(0.3)
        check(modes[1][0] == "exact_kv_events" and int(modes[1][1]) > 0,
              f"{model} tool follow-up: the second send must hit the cache exactly: {modes}")


def typed_errors(client):
    for model in MODELS:
        # Beyond the workers' 32k context: refused by the worker, classified by Cortex.
        e = expect_error(
            openai.BadRequestError,
            "context_length_exceeded",
            lambda: client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=100_000),
            f"{model} context length",
        )
        check("context length" in str(e), f"{model}: the worker's message is kept: {e}")
    expect_error(
        openai.NotFoundError,
        "model_not_found",
        lambda: client.chat.completions.create(model="gpt-nope", messages=MESSAGES),
        "unknown model",
    )
    expect_error(
        openai.BadRequestError,
        "invalid_request",
        lambda: client.chat.completions.create(model=VLLM, messages=[]),
        "empty messages",
    )
    missing = getattr(openai, "omit", None) or openai.NOT_GIVEN
    e = expect_error(
        openai.BadRequestError,
        "model_required",
        lambda: client.completions.create(model=missing, prompt="hi", max_tokens=2),
        "no model",
    )
    check(VLLM in str(e) and SGLANG in str(e), f"the models served are named: {e}")


async def concurrent(base, n=96, limit=32):
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    gate = asyncio.Semaphore(limit)
    peak = 0
    running = 0

    async def one(i):
        nonlocal peak, running
        async with gate:
            running += 1
            peak = max(peak, running)
            try:
                model = MODELS[i % 2]
                if i % 3 == 0:
                    r = await client.completions.create(model=model, prompt=f"request {i}", max_tokens=4)
                    return bool(r.choices[0].text)
                if i % 3 == 1:
                    stream = await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=4, stream=True
                    )
                    return bool("".join([c.choices[0].delta.content or "" async for c in stream if c.choices]))
                r = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=4
                )
                return bool(r.choices[0].message.content)
            finally:
                running -= 1

    started = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(n)))
    await client.close()
    check(all(results), f"async: {results.count(False)} of {n} answers empty")
    check(peak == limit, f"async: peak concurrency {peak}, wanted {limit}")
    print(f"sdk-check: {n} async requests at concurrency {limit} in {time.monotonic() - started:.1f}s")


def generate(base):
    r = requests.post(f"{base}/generate", json={"text": "KV caches are", "sampling_params": {"max_new_tokens": 8}}, timeout=30)
    check(r.status_code == 200, f"/generate: {r.status_code} {r.text}")
    body = r.json()
    check(body["text"] and body["meta_info"]["prompt_tokens"] > 0, f"/generate: {body}")
    check(r.headers.get("x-cortex-assigned-worker", "").startswith("sim-sglang"), f"/generate: {r.headers}")
    with requests.post(
        f"{base}/generate",
        json={"text": "KV caches are", "stream": True, "sampling_params": {"max_new_tokens": 8}},
        stream=True,
        timeout=30,
    ) as r:
        events = [l for l in r.iter_lines(decode_unicode=True) if l.startswith("data: ")]
    check(events and events[-1] == "data: [DONE]", f"/generate stream: {events[-3:]}")
    check(all("text" in json.loads(e[6:]) for e in events[:-1]), "/generate stream: an event without text")
    r = requests.post(f"{base}/generate", json={"model": VLLM, "text": "hi"}, timeout=30)
    check(r.status_code == 400, f"/generate for vLLM: {r.status_code}")
    check(r.json()["error"]["code"] == "unsupported_route", f"/generate for vLLM: {r.text}")
    r = requests.post(f"{base}/generate", json={"sampling_params": {}}, timeout=30)
    check(set(r.json()["error"]) == {"message", "code"}, f"/generate errors are SGLang's: {r.text}")


def broken_stream(client, admin, token):
    # Every vLLM worker will cut its next stream after two tokens (the SDK must raise, not
    # return a short answer). Last: the faults stay armed on the workers the stream missed.
    headers = {"authorization": f"Bearer {token}"}
    workers = requests.get(f"{admin}/admin/workers", headers=headers, timeout=30).json()["workers"]
    vllm = [w["url"] for w in workers if w["engine"] == "vllm"]
    check(vllm, f"the admin API lists the vLLM workers: {workers}")
    for url in vllm:
        r = requests.post(f"{url}/sim/fault", json={"die_mid_stream": {"after_tokens": 2, "count": 1}}, timeout=30)
        check(r.status_code == 200, f"fault on {url}: {r.status_code} {r.text}")
    stream = client.chat.completions.create(model=VLLM, messages=MESSAGES, max_tokens=16, stream=True)
    e = expect_error(openai.APIError, "server_error", lambda: [c for c in stream], "a stream broken mid-way")
    check("stream broke" in str(e), f"the error says what happened: {e}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--admin", required=True)
    p.add_argument("--token", required=True)
    a = p.parse_args()
    client = openai.OpenAI(base_url=f"{a.base}/v1", api_key="unused", max_retries=0)
    chat_and_completions(client)
    typed_errors(client)
    tool_calling(client)
    asyncio.run(concurrent(a.base))
    generate(a.base)
    broken_stream(client, a.admin, a.token)
    print(f"sdk-check: openai {openai.__version__}, requests {requests.__version__}: {checks} checks passed")


if __name__ == "__main__":
    main()
