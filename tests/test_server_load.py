"""A bounded load test on loopback: 64 concurrent `openai` clients, mixed K, streaming and not,
completions and chat, against the tiny DB-AR server. No errors, every response complete, seeded
responses identical to the same request sent alone, all slots free afterwards, within 60 s."""

from __future__ import annotations

import asyncio
import random
import time

import openai
import pytest

from test_server import Served, train_tiny_db, wait_idle

pytestmark = pytest.mark.usefixtures("one_thread")

CLIENTS = 64
PROMPTS = ["And God said", "In the beginning", "Blessed are", "The LORD is", "And it came to pass", "Behold"]


@pytest.fixture(scope="module")
def db(tmp_path_factory, write_config):
    with Served(train_tiny_db(tmp_path_factory, write_config), "tiny-db") as s:
        yield s


def plan(i: int) -> dict:
    rng = random.Random(i)
    return {"kind": rng.choice(["completion", "chat"]), "stream": rng.random() < 0.5, "k": rng.choice([1, 2, 4, 8]),
            "max_tokens": rng.randint(4, 16), "prompt": rng.choice(PROMPTS), "n": 2 if i % 16 == 0 else 1,
            "seed": i}


async def one(client: openai.AsyncOpenAI, p: dict) -> tuple[list[str], list[str], int, int | None]:
    """-> (texts per choice, finish reasons, completion tokens, K reported)."""
    common = dict(model=f"tiny-db@{p['k']}", max_tokens=p["max_tokens"], temperature=0.7, seed=p["seed"], n=p["n"],
                  extra_body={"ignore_eos": True})
    texts, reasons = [""] * p["n"], [None] * p["n"]
    if p["kind"] == "completion" and not p["stream"]:
        r = await client.completions.create(prompt=p["prompt"], **common)
        return [c.text for c in r.choices], [c.finish_reason for c in r.choices], r.usage.completion_tokens, \
            r.num_iterations
    if p["kind"] == "chat" and not p["stream"]:
        r = await client.chat.completions.create(messages=[{"role": "user", "content": p["prompt"]}], **common)
        return [c.message.content for c in r.choices], [c.finish_reason for c in r.choices], \
            r.usage.completion_tokens, r.num_iterations
    if p["kind"] == "completion":
        stream = await client.completions.create(prompt=p["prompt"], stream=True,
                                                 stream_options={"include_usage": True}, **common)
    else:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": p["prompt"]}], stream=True,
                                                      stream_options={"include_usage": True}, **common)
    usage, k = None, None
    async for chunk in stream:
        k = chunk.num_iterations
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            texts[c.index] += c.text if p["kind"] == "completion" else (c.delta.content or "")
            reasons[c.index] = c.finish_reason or reasons[c.index]
    return texts, reasons, usage, k


def test_64_concurrent_clients_mixed_k_and_streaming(db):
    plans = [plan(i) for i in range(CLIENTS)]

    async def run_all():
        async with openai.AsyncOpenAI(base_url=db.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            start = time.perf_counter()
            results = await asyncio.gather(*(one(client, p) for p in plans), return_exceptions=True)
            elapsed = time.perf_counter() - start
            alone = [await one(client, p) for p in plans[:6]]  # the same requests, one at a time
        return results, elapsed, alone

    calls_before, rows_before = db.engine.stats.decode_calls, db.engine.stats.decoded_rows
    results, elapsed, alone = asyncio.run(run_all())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    for p, (texts, reasons, tokens, k) in zip(plans, results):
        assert reasons == ["length"] * p["n"], (p, reasons)  # complete: ended by max_tokens, nothing cut
        assert tokens == p["max_tokens"] * p["n"] and k == p["k"]
        assert all(texts), p
    for p, solo, loaded in zip(plans, alone, results):
        assert solo[0] == loaded[0], p  # batching changes nothing (seeded sampling)
    assert elapsed < 60
    batched = (db.engine.stats.decoded_rows - rows_before) / (db.engine.stats.decode_calls - calls_before)
    assert batched > 2, batched  # rows really decoded together
    wait_idle(db.engine)
    assert db.engine.num_free_slots == db.engine.stats.num_slots
    assert 'status="500"' not in db.http.get("/metrics").text
