"""The fields benchmark clients and evaluation harnesses send, in-process on the tiny random model.

guidellm's streaming benchmark and aiperf's ``--per-chunk-usage`` send vLLM's
``stream_options.continuous_usage_stats``; lm-evaluation-harness's ``remote`` tokenizer reads
``/tokenizer_info``; SDKs that serialize every attribute send ``null`` for optional fields;
proxies match answers to requests by ``X-Request-Id``; ``client.models.retrieve`` asks for
``/v1/models/{id}``. Each of these was a 400 or a 404 before.
"""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from lifeofprompt.engine.llm_engine import LLMEngine  # noqa: E402
from lifeofprompt.lessons.server_thread import ServerThread  # noqa: E402
from lifeofprompt.serving.openai_protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from lifeofprompt.serving.server import ServerConfig  # noqa: E402
from lifeofprompt.serving.tokenizer_routes import tokenizer_info  # noqa: E402

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server():
    from tiny_models import build_tiny_model

    model, tokenizer = build_tiny_model()
    tokenizer.chat_template = "tags"
    engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=128, max_num_seqs=8, log_stats=False)
    with ServerThread(engine, model_name="tiny", config=ServerConfig(api_key=KEY, shutdown_timeout=5)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


# ----------------------------------------------------------------------------- usage on every chunk


def streamed_with_usage(client, chat: bool, n: int):
    common = dict(
        model="tiny",
        n=n,
        max_tokens=7,
        temperature=1.0,
        seed=3,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    if chat:
        return list(client.chat.completions.create(messages=HELLO, **common))
    return list(client.completions.create(prompt="hello there", **common))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("n", [1, 2])
def test_continuous_usage_stats_puts_each_choices_count_so_far_on_every_chunk(client, chat, n):
    """Every chunk carries usage: its choice's prompt and the tokens that choice has so far (vLLM
    counts per choice), never decreasing, ending at the choice's whole count; the last chunk has the totals."""
    chunks = streamed_with_usage(client, chat, n)
    *answer_chunks, totals = chunks
    assert totals.choices == [] and totals.usage is not None
    prompt_tokens = totals.usage.prompt_tokens  # one prompt, counted once
    assert prompt_tokens > 0
    so_far, ids = {i: 0 for i in range(n)}, {i: [] for i in range(n)}
    for chunk in answer_chunks:
        assert chunk.usage is not None, "a chunk without usage"
        (choice,) = chunk.choices
        usage = chunk.usage
        assert usage.prompt_tokens == prompt_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert usage.completion_tokens >= so_far[choice.index]
        so_far[choice.index] = usage.completion_tokens
        ids[choice.index] += getattr(choice, "token_ids", None) or []
        assert usage.completion_tokens == len(ids[choice.index])
    assert so_far == {i: 7 for i in range(n)}  # ignore_eos: every answer is max_tokens long
    assert totals.usage.completion_tokens == 7 * n
    assert totals.usage.total_tokens == prompt_tokens + 7 * n


def test_continuous_usage_stats_without_include_usage_adds_nothing_as_in_vllm(client):
    chunks = list(
        client.completions.create(
            model="tiny", prompt="hi", max_tokens=3, stream=True, stream_options={"continuous_usage_stats": True}
        )
    )
    assert chunks and all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_include_usage_alone_leaves_the_other_chunks_without_usage(client):
    chunks = list(
        client.completions.create(
            model="tiny", prompt="hi", max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens > 0


# ----------------------------------------------------------------------------- null means the default


def optional_fields(body_type) -> list[str]:
    return [name for name, field in body_type.model_fields.items() if not field.is_required()]


@pytest.mark.parametrize(
    "path, body_type, required",
    [
        ("/v1/completions", CompletionRequest, {"prompt": "hello", "max_tokens": 3}),
        ("/v1/chat/completions", ChatCompletionRequest, {"messages": HELLO, "max_completion_tokens": 3}),
        ("/v1/chat/completions", ChatCompletionRequest, {"messages": HELLO, "max_tokens": 3}),
    ],
)
def test_null_for_every_optional_field_means_its_default(server, path, body_type, required):
    """OpenAI reads ``"n": null`` or ``"stream": null`` as the default; so do we, for every optional field
    (each body once with every other optional field null; the length cap is set to keep it short)."""
    fields = optional_fields(body_type)
    assert {"n", "stream", "ignore_eos", "return_token_ids", "stream_options", "logprobs"} <= set(fields)
    nulls = {name: None for name in fields if name not in required}
    body = {**nulls, **required}
    answer = httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)
    assert answer.status_code == 200, answer.text
    payload = answer.json()
    assert len(payload["choices"]) == 1 and payload["usage"]["completion_tokens"] <= 16
    message = [{"role": "user", "content": None}]  # a message's optional content too
    if path.endswith("chat/completions"):
        answer = httpx.post(server.url + path, json={**body, "messages": message}, headers=AUTH, timeout=60)
        assert answer.status_code == 200, answer.text


def test_null_for_a_required_field_is_still_a_400_naming_it(server):
    answer = httpx.post(server.url + "/v1/completions", json={"prompt": None, "n": None}, headers=AUTH)
    assert answer.status_code == 400 and answer.json()["error"]["param"].startswith("prompt")


# ----------------------------------------------------------------------------- X-Request-Id


def test_x_request_id_is_echoed_on_answers_streams_and_errors(server):
    url = server.url
    whole = httpx.post(
        url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2},
        headers={**AUTH, "X-Request-Id": "req-whole-1"},
    )
    assert whole.status_code == 200 and whole.headers["x-request-id"] == "req-whole-1"
    body = {"messages": HELLO, "max_tokens": 2, "stream": True}
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, headers={**AUTH, "X-Request-Id": "req-stream-2"}
    ) as stream:
        assert stream.headers["x-request-id"] == "req-stream-2"
        assert stream.read().decode().rstrip().endswith("data: [DONE]")
    wrong_model = httpx.post(
        url + "/v1/completions", json={"model": "nope", "prompt": "hi"}, headers={**AUTH, "X-Request-Id": "req-404"}
    )
    assert wrong_model.status_code == 404 and wrong_model.headers["x-request-id"] == "req-404"
    no_key = httpx.get(url + "/v1/models", headers={"X-Request-Id": "req-401"})
    assert no_key.status_code == 401 and no_key.headers["x-request-id"] == "req-401"


def test_a_request_without_an_id_gets_a_fresh_one(server):
    ids = [httpx.get(server.url + "/v1/models", headers=AUTH).headers.get("x-request-id") for _ in range(2)]
    assert all(i is not None and re.fullmatch(r"[0-9a-f]{32}", i) for i in ids) and ids[0] != ids[1]


# ----------------------------------------------------------------------------- GET /v1/models/{id}


def test_models_retrieve_gives_the_card_or_a_model_not_found(client):
    card = client.models.retrieve("tiny")
    assert (card.id, card.object, card.owned_by) == ("tiny", "model", "lifeofprompt")
    assert card.max_model_len > 0 and card == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("HuggingFaceTB/other-model")  # a slash in the name is still one id
    assert missing.value.body["type"] == "model_not_found"


# ----------------------------------------------------------------------------- /tokenizer_info


def test_tokenizer_info_is_behind_the_key_and_has_what_lm_eval_reads(server):
    assert httpx.get(server.url + "/tokenizer_info").status_code == 401
    answer = httpx.get(server.url + "/tokenizer_info", headers=AUTH)
    assert answer.status_code == 200, answer.text
    info = answer.json()
    assert info["tokenizer_class"] == "ByteTokenizer" and info["chat_template"] == "tags"
    assert {"bos_token", "eos_token", "pad_token", "unk_token"} <= set(info)  # null: the byte tokenizer has no texts


def test_tokenizer_info_for_smollm2_matches_the_tokenizer(smollm2):
    """What lm-evaluation-harness's remote tokenizer does with it: the eos text, tokenized without
    special tokens, is the eos id; the chat template is the model's own; no server file paths leak."""
    _, tokenizer = smollm2
    info = json.loads(json.dumps(tokenizer_info(tokenizer)))
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert tokenizer.encode(info["eos_token"], add_special_tokens=False) == [tokenizer.eos_token_id]
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] > 0
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert not {"vocab_file", "merges_file", "tokenizer_file", "name_or_path"} & set(info)
