"""`/v1/completions` and `/v1/models` through OpenAI's own Python client (and plain HTTP where the client
cannot send a bad request), against the app served as `dipaco serve` serves it on loopback."""

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_lm_eval import offline  # noqa: F401 (a fixture: nothing may leave the machine)
from test_serve import PROMPTS, needs_web, running

import dipaco.serve.http as http_module
from dipaco.data.packing import eval_windows
from dipaco.model.scoring import Scoring, score_documents, window_nll
from dipaco.serve.http import AppOptions, create_app
from dipaco.serve.openai_api import COMPLETIONS, MAX_LOGPROBS
from dipaco.serve.pipeline import Pipeline

MAX_PROMPT_TOKENS = 48
MAX_NEW_TOKENS_CAP = 24
MAX_PROMPTS = 4
TOKEN = "s3cret-token"


def needs_openai():
    needs_web()
    return pytest.importorskip("openai")


@pytest.fixture(scope="module")
def pipe(served_run):
    return Pipeline.from_run(served_run.run.dir)


@pytest.fixture(scope="module")
def server(pipe):
    """The app with a token and small caps; yields its port."""
    needs_openai()
    caps = AppOptions(max_prompt_tokens=MAX_PROMPT_TOKENS, max_new_tokens_cap=MAX_NEW_TOKENS_CAP, max_prompts=MAX_PROMPTS,
                      batch_wait_ms=50)
    with running(create_app(pipe, caps, token=TOKEN)) as port:
        yield port


@pytest.fixture(scope="module")
def client(server):
    openai = needs_openai()
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key=TOKEN, max_retries=0, timeout=60)


def post(port: int, body, path: str = "/v1/completions", token: str | None = TOKEN,
         content_type: str | None = "application/json", method: str = "POST") -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {**({"Content-Type": content_type} if content_type else {}),
               **({"Authorization": f"Bearer {token}"} if token else {})}
    payload = None if body is None else body if isinstance(body, (bytes, str)) else json.dumps(body)
    conn.request(method, path, body=payload, headers=headers)
    resp = conn.getresponse()
    status, data = resp.status, json.loads(resp.read() or b"null")
    conn.close()
    return status, data


def test_models_lists_the_served_experiment(client, pipe):
    models = client.models.list()
    assert [m.id for m in models.data] == [pipe.experiment]
    assert client.models.retrieve(pipe.experiment).owned_by == "dipaco"


def test_a_completion_is_generate_on_the_routed_path(client, pipe, server):
    out = client.completions.create(model=pipe.experiment, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    status, generated = post(server, {"prompt": PROMPTS[0], "max_new_tokens": 6}, path="/v1/generate")
    assert status == 200
    [choice] = out.choices
    assert choice.text == generated["text"] and choice.finish_reason == "length"
    assert choice.path == generated["path"] == pipe.route(PROMPTS[0])[0]  # the extra field names the path
    assert out.model == pipe.experiment and out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.usage.prompt_tokens == len(pipe.encode(PROMPTS[0])) and out.usage.completion_tokens == 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6


def test_token_id_prompts_equal_their_texts(client, pipe):
    texts = PROMPTS[:3]
    by_text = client.completions.create(model=pipe.experiment, prompt=texts, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=pipe.experiment, prompt=[pipe.encode(t) for t in texts], max_tokens=5,
                                       temperature=0)
    single = client.completions.create(model=pipe.experiment, prompt=pipe.encode(texts[1]), max_tokens=5, temperature=0)
    assert [c.index for c in by_ids.choices] == [0, 1, 2]
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert [c.path for c in by_ids.choices] == [pipe.route(t)[0] for t in texts]
    assert single.choices[0].text == by_ids.choices[1].text


def test_seeded_sampling_repeats(client, pipe):
    def sample(seed: int) -> str:
        return client.completions.create(model=pipe.experiment, prompt=PROMPTS[2], max_tokens=8, temperature=1.5,
                                         top_p=0.9, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(6)}) > 1  # the seed matters (6 seeds of 8 tokens cannot all agree by chance)


def test_streaming_sends_the_same_text_then_done(client, pipe, server, monkeypatch):
    # Tokens that come faster than the event loop wakes coalesce into one event (by design): on a loaded machine
    # all 10 came before the first wake-up. Pausing the decoding thread after each token gives the loop time to
    # send the first ones while the rest are still to come.
    poke = http_module.Wakeup.poke

    def slow_poke(self) -> None:
        poke(self)
        time.sleep(0.03)

    monkeypatch.setattr(http_module.Wakeup, "poke", slow_poke)
    whole = client.completions.create(model=pipe.experiment, prompt=PROMPTS[3], max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=pipe.experiment, prompt=PROMPTS[3], max_tokens=10, temperature=0,
                                            stream=True))
    assert len(chunks) >= 2 and all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert {c.choices[0].path for c in chunks} == {whole.choices[0].path}
    counted = list(client.completions.create(model=pipe.experiment, prompt=PROMPTS[3], max_tokens=10, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
    assert counted[-1].choices == [] and counted[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert counted[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # The wire format itself: server-sent events, the last one [DONE].
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": pipe.experiment, "prompt": PROMPTS[3], "max_tokens": 3,
                                                        "stream": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    assert resp.getheader("content-type").startswith("text/event-stream")
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_a_stop_string_ends_the_completion_before_it(client, pipe):
    prompt = PROMPTS[4]
    full = client.completions.create(model=pipe.experiment, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    assert len(full) >= 4
    stop = full[len(full) // 2: len(full) // 2 + 2]
    expected = full[: full.index(stop)]
    cut = client.completions.create(model=pipe.experiment, prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "\x00"])
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 16  # decoding stopped there, not after max_tokens
    streamed = client.completions.create(model=pipe.experiment, prompt=prompt, max_tokens=16, temperature=0, stop=stop,
                                         stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected and chunks[-1].choices[0].finish_reason == "stop"


def dipaco_token_logprobs(pipe: Pipeline, path: int, ids: list[int]) -> list[float]:
    """Each token's log-probability after the first, by dipaco's own scoring (dipaco.model.scoring) on ``path``."""
    model = pipe.cache.get(path).model
    windows = eval_windows([ids], pipe.spec.seq_len, prefix_tokens=0)
    [(_, _, nll)] = list(window_nll(model, windows, batch_size=1, pad_id=pipe.tokenizer.pad_token_id))
    return (-nll[0, : len(ids) - 1]).tolist()


def test_echo_logprobs_equal_dipaco_scoring(client, pipe):
    text = PROMPTS[5] + " and the results were published on Monday"
    ids = pipe.encode(text)
    out = client.completions.create(model=pipe.experiment, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    [choice] = out.choices
    lp = choice.logprobs
    path = pipe.route(text)[0]
    assert choice.path == path and choice.text == text and out.usage.completion_tokens == 0
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(dipaco_token_logprobs(pipe, path, ids), abs=1e-4)
    # The sum is dipaco's document score with the first token as context.
    scores = score_documents(pipe.cache.get(path).model, [ids],
                             Scoring(pipe.spec.seq_len, 1, 1, pipe.tokenizer.pad_token_id))
    assert sum(lp.token_logprobs[1:]) == pytest.approx(-float(scores.nll[0]), abs=1e-3)
    # The tokens spell the text at their offsets; each position's alternatives hold the token itself.
    assert "".join(lp.tokens) == text
    assert all(text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens))
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == value and len(top) <= 3 and max(top.values()) >= value


def test_echo_with_a_new_token_is_what_lm_eval_asks(client, pipe):
    """lm-eval's loglikelihood request: echo, logprobs=1, max_tokens=1; the prompt's part equals max_tokens=0's."""
    ids = pipe.encode(PROMPTS[6])
    scored = client.completions.create(model=pipe.experiment, prompt=[ids], max_tokens=0, echo=True, logprobs=1)
    plus_one = client.completions.create(model=pipe.experiment, prompt=[ids], max_tokens=1, echo=True, logprobs=1,
                                         temperature=0, seed=1234)
    a, b = scored.choices[0].logprobs, plus_one.choices[0].logprobs
    assert len(b.token_logprobs) == len(ids) + 1 and b.token_logprobs[0] is None
    assert b.token_logprobs[1:-1] == pytest.approx(a.token_logprobs[1:], abs=1e-5)
    assert b.token_logprobs[-1] == max(b.top_logprobs[-1].values())  # greedy: the best token
    assert plus_one.choices[0].text.startswith(scored.choices[0].text)


def metric(port: int, name: str, **labels: str) -> float:
    """The sum of a metric's samples in the server's /metrics (those with ``labels``, if given)."""
    import http.client

    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    text = conn.getresponse().read().decode()
    conn.close()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


def batch_rows(port: int) -> tuple[float, float]:
    """(forward passes, rows decoded) so far."""
    return metric(port, "dipaco_batch_size_count"), metric(port, "dipaco_batch_size_sum")


def test_a_stream_whose_client_leaves_stops_decoding(client, pipe, server):
    body = {"model": pipe.experiment, "prompt": PROMPTS[7], "max_tokens": MAX_NEW_TOKENS_CAP, "temperature": 0}
    assert client.completions.create(**body).usage.completion_tokens == MAX_NEW_TOKENS_CAP  # no early EOS
    before = metric(server, "dipaco_generated_tokens_total")
    answered = metric(server, "dipaco_requests_total", endpoint=COMPLETIONS)
    raw = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: " + str(len(raw)).encode()
                     + b"\r\n\r\n" + raw)
    # Gone while its row waited for a batch (batch_wait_ms=50): the row is dropped, not decoded to the end.
    # Its request is logged once its stream has ended, the row cancelled; a row's tokens are counted when it
    # ends, and the next completion, decoded by the same worker, ends after a cancelled row has (at its next
    # step). Waited for as events, not a fixed time a loaded machine may not have finished the row in.
    deadline = time.monotonic() + 60
    while metric(server, "dipaco_requests_total", endpoint=COMPLETIONS) == answered:
        assert time.monotonic() < deadline, "the stream whose client left did not end"
        time.sleep(0.02)
    again = client.completions.create(**body)
    assert again.choices[0].text  # the server goes on
    left_with = metric(server, "dipaco_generated_tokens_total") - before - again.usage.completion_tokens
    assert left_with < MAX_NEW_TOKENS_CAP


def test_completions_share_generates_batches(client, pipe, server):
    """Concurrent completions and generate requests of one path decode in the same batches."""
    path = pipe.route(PROMPTS[0])[0]
    same = [p for p in PROMPTS if pipe.route(p)[0] == path]
    passes0, rows0 = batch_rows(server)
    barrier = threading.Barrier(4)

    def completion(i: int) -> str:
        barrier.wait()
        if i % 2:
            return post(server, {"prompt": same[i % len(same)], "max_new_tokens": 8}, path="/v1/generate")[1]["text"]
        return client.completions.create(model=pipe.experiment, prompt=same[i % len(same)], max_tokens=8,
                                         temperature=0).choices[0].text

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(completion, range(4)))
    passes1, rows1 = batch_rows(server)
    assert all(texts)
    assert (rows1 - rows0) / (passes1 - passes0) > 1.0  # rows per forward pass: requests shared passes


BAD = [  # (body, status, param)
    ({"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ({"model": None, "prompt": "a", "n": 2}, 400, "n"),
    ({"model": None, "prompt": "a", "best_of": 3}, 400, "best_of"),
    ({"model": None, "prompt": "a", "logprobs": MAX_LOGPROBS + 1}, 400, "logprobs"),
    ({"model": None, "prompt": ["a"] * (MAX_PROMPTS + 1)}, 400, "prompt"),
    ({"model": None, "prompt": [[1, 2], [10**6]]}, 400, "prompt"),
    ({"model": None, "prompt": [-1]}, 400, "prompt"),
    ({"model": None, "prompt": []}, 400, "prompt"),
    ({"model": None, "prompt": [[]]}, 400, "prompt"),
    ({"model": None, "prompt": ""}, 400, "prompt"),
    ({"model": None, "prompt": [1, "a"]}, 400, "prompt"),
    ({"model": None, "prompt": 5}, 400, "prompt"),
    ({"model": None, "prompt": [7] * (MAX_PROMPT_TOKENS + 1)}, 400, "prompt"),
    ({"model": None, "prompt": "a", "max_tokens": MAX_NEW_TOKENS_CAP + 1}, 400, "max_tokens"),
    ({"model": None, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": None, "prompt": "a", "stream": True, "echo": True}, 400, "stream"),
    ({"model": None, "prompt": "a", "stream": True, "logprobs": 1}, 400, "stream"),
    ({"model": None, "prompt": ["a", "b"], "stream": True}, 400, "stream"),
    ({"model": None, "prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": None, "prompt": "a", "stream": True, "stream_options": {"usage": True}}, 400, "stream_options"),
    ({"model": None, "prompt": "a", "suffix": "b"}, 400, "suffix"),
    ({"model": None, "prompt": "a", "temperature": 3}, 400, "temperature"),
    ({"model": None, "prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": None, "prompt": "a", "stop": [""]}, 400, "stop"),
    ({"model": None, "prompt": "a", "stop": ["x"] * 17}, 400, "stop"),
    ({"model": None, "prompt": ["\ud800"]}, 400, "prompt"),
    ({"prompt": "a"}, 400, "model"),
    # Controls this server does not apply: only their neutral values are taken (test_neutral_values_...).
    ({"model": None, "prompt": "a", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"model": None, "prompt": "a", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ({"model": None, "prompt": "a", "presence_penalty": -1}, 400, "presence_penalty"),
    ({"model": None, "prompt": "a", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ({"model": None, "prompt": "a", "logit_bias": {"5": 0.5}}, 400, "logit_bias"),
    ({"model": None, "prompt": "a", "stream": True, "stream_options": {"include_obfuscation": True}}, 400,
     "stream_options"),
    # null is a default only where OpenAI's schema allows it, and only of a field this server knows.
    ({"model": None, "prompt": "a", "user": None}, 400, "user"),
    ({"model": None, "prompt": "a", "temprature": None}, 400, "temprature"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_errors(server, pipe, body, status, param):
    if body.get("model", "") is None:
        body = {**body, "model": pipe.experiment}
    got, data = post(server, json.dumps(body, ensure_ascii=True).encode())
    assert (got, data["error"]["param"]) == (status, param), data
    assert set(data["error"]) == {"message", "type", "param", "code"} and data["error"]["message"]
    assert data["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_the_client_raises_openais_exceptions(client, pipe, server):
    openai = needs_openai()
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="text-davinci-003", prompt="a")
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="n=1"):
        client.completions.create(model=pipe.experiment, prompt="a", n=2)
    wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=pipe.experiment, prompt="a")
    status, data = post(server, b"{not json")
    assert status == 400 and data["error"]["type"] == "invalid_request_error"
    status, data = post(server, {"model": pipe.experiment, "prompt": "a"}, token=None)
    assert status == 401 and data["error"]["code"] == "invalid_api_key"
    status, data = post(server, "x" * 10**6)
    assert status == 413 and "max_body_bytes" in data["error"]["message"]


def test_nan_and_infinity_are_refused_not_500(server, pipe):
    for raw in (b'{"model": "%s", "prompt": "a", "temperature": NaN}', b'{"model": "%s", "prompt": "a", "top_p": 1e999}'):
        status, data = post(server, raw % pipe.experiment.encode())
        assert status == 400 and data["error"]["param"] in ("temperature", "top_p")


def test_a_prompt_list_cap_below_one_is_refused_at_start(pipe):
    needs_web()
    from dipaco.errors import DipacoError

    with pytest.raises(DipacoError, match="--max-prompts must be >= 1, got 0"):
        create_app(pipe, AppOptions(max_prompts=0))


# --- what real clients send (issue 76) --------------------------------------------------------------
def greedy(client, pipe, prompt, max_tokens: int = 6, **extra) -> str:
    return client.completions.create(model=pipe.experiment, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     **extra).choices[0].text


@pytest.mark.usefixtures("offline")
def test_langchains_openai_llm_invokes_and_streams(client, pipe, server):
    """LangChain's completions LLM sends frequency_penalty and presence_penalty (0) on every call."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.OpenAI(model=pipe.experiment, base_url=f"http://127.0.0.1:{server}/v1", api_key=TOKEN,
                                  max_tokens=6, temperature=0, max_retries=0, timeout=60, logit_bias={})
    expected = greedy(client, pipe, PROMPTS[1])
    assert llm.invoke(PROMPTS[1]) == expected
    assert "".join(llm.stream(PROMPTS[1])) == expected


def test_neutral_values_of_unsupported_controls_are_accepted(client, pipe, server):
    expected = greedy(client, pipe, PROMPTS[2])
    assert greedy(client, pipe, PROMPTS[2], frequency_penalty=0, presence_penalty=0, logit_bias={}, user="someone",
                  suffix=None) == expected
    body = {"model": pipe.experiment, "prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0, "frequency_penalty": 0.0,
            "logit_bias": {"5": 0}, "suffix": "", "stream_options": None}
    status, out = post(server, body)
    assert status == 200 and out["choices"][0]["text"] == expected
    openai = needs_openai()
    with pytest.raises(openai.BadRequestError, match="frequency_penalty: only 0 is supported") as refused:
        greedy(client, pipe, PROMPTS[2], frequency_penalty=1)
    assert refused.value.param == "frequency_penalty"


NULLABLE = ("max_tokens", "temperature", "top_p", "n", "best_of", "stop", "seed", "stream", "stream_options", "logprobs",
            "echo", "frequency_penalty", "presence_penalty", "logit_bias", "suffix")  # OpenAI's schema: "or null"


def test_null_is_the_default_wherever_openai_allows_it(server, pipe):
    def answer(body: dict) -> dict:
        status, out = post(server, {"model": pipe.experiment, "prompt": PROMPTS[3], **body})
        assert status == 200, out
        return out

    # Seeded sampling at the default temperature and top_p, the default max_tokens, no stream, no echo.
    defaults, nulls = answer({"seed": 11}), answer({**dict.fromkeys(NULLABLE), "seed": 11})
    assert nulls["choices"] == defaults["choices"] and nulls["usage"] == defaults["usage"]
    assert defaults["usage"]["completion_tokens"] == 16 and defaults["choices"][0]["logprobs"] is None
    unseeded = answer({**dict.fromkeys(NULLABLE), "temperature": 0})
    assert unseeded["choices"][0]["text"] == answer({"temperature": 0})["choices"][0]["text"]


def test_a_null_prompt_is_the_document_separator(client, pipe):
    eos = pipe.tokenizer.eos_token_id
    by_null = client.completions.create(model=pipe.experiment, prompt=None, max_tokens=0, echo=True, logprobs=0)
    [choice] = by_null.choices
    assert by_null.usage.prompt_tokens == 1 and choice.logprobs.tokens == [pipe.tokenizer.eos_token]
    assert choice.text == pipe.tokenizer.eos_token and choice.path == pipe.plan("", ids=[eos], max_new_tokens=1).path
    assert greedy(client, pipe, None) == greedy(client, pipe, [eos])


@pytest.mark.parametrize("field,value,where", [
    ("prompt", "a \ud800 b", "it holds"), ("prompt", ["a", "\udfff"], "item 1 holds"), ("stop", "\ud800", "it holds"),
    ("user", "\udc00", "it holds"),
])
def test_a_lone_surrogate_is_named_in_every_field(server, pipe, field, value, where):
    body = {"model": pipe.experiment, "prompt": "a", "max_tokens": 2, field: value}
    status, data = post(server, json.dumps(body, ensure_ascii=True).encode())
    assert (status, data["error"]["param"]) == (400, field)
    assert data["error"]["message"] == f"{field}: not valid Unicode: {where} a lone surrogate (\\ud800-\\udfff)"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/generate"])
@pytest.mark.parametrize("content_type,got", [("application/x-www-form-urlencoded", "got 'application/x-www-form-urlencoded'"),
                                              (None, "none was sent"), ("text/plain", "got 'text/plain'")])
def test_a_body_not_sent_as_json_names_the_content_type(server, pipe, path, content_type, got):
    body = {"model": pipe.experiment, "prompt": "a"} if path == COMPLETIONS else {"prompt": "a"}
    status, data = post(server, json.dumps(body), path=path, content_type=content_type)
    message = f"Content-Type: the body is read as JSON only with 'Content-Type: application/json' ({got})"
    assert status == 415
    assert data == ({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
                    if path == COMPLETIONS else {"detail": message})
    for empty in (b"", b"null"):
        status, data = post(server, empty, path=path)
        assert status == (400 if path == COMPLETIONS else 422) and "the request body is empty (or null)" in json.dumps(data)
    status, data = post(server, json.dumps(body), path=path, content_type="application/json; charset=utf-8")
    assert status == 200, data


def test_echo_of_a_token_id_prompt_spells_its_special_tokens(client, pipe):
    """A token-id prompt may hold special tokens (lm-eval's context may start with the EOS): the echoed text is
    its tokens' texts one after the other, each token at its offset."""
    tok = pipe.tokenizer
    ids = [tok.eos_token_id, *pipe.encode("The film won"), tok.eos_token_id, tok.pad_token_id, *pipe.encode(" three")]
    scored = client.completions.create(model=pipe.experiment, prompt=ids, max_tokens=0, echo=True, logprobs=1).choices[0]
    lp = scored.logprobs
    assert scored.text == "".join(lp.tokens) == f"{tok.eos_token}The film won{tok.eos_token}{tok.pad_token} three"
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
    continued = client.completions.create(model=pipe.experiment, prompt=ids, max_tokens=3, echo=True, logprobs=1,
                                          temperature=0).choices[0]
    more = continued.logprobs
    assert continued.text == scored.text + greedy(client, pipe, ids, max_tokens=3)
    assert more.tokens[: len(ids)] == lp.tokens and more.text_offset[: len(ids)] == lp.text_offset
    assert all(len(scored.text) <= o <= len(continued.text) for o in more.text_offset[len(ids):])
    assert more.token_logprobs[1: len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    echoed = client.completions.create(model=pipe.experiment, prompt=ids, max_tokens=3, echo=True, temperature=0)
    assert echoed.choices[0].text == continued.text  # without logprobs, the same text


def test_a_trailing_slash_is_the_route_without_it(server, pipe):
    body = {"model": pipe.experiment, "prompt": PROMPTS[4], "max_tokens": 4, "temperature": 0}
    plain, slashed = post(server, body), post(server, body, path="/v1/completions/")
    assert slashed[0] == 200 and slashed[1]["choices"] == plain[1]["choices"]
    assert post(server, None, path="/v1/models/", method="GET") == post(server, None, path="/v1/models", method="GET")
    assert post(server, None, path=f"/v1/models/{pipe.experiment}/", method="GET")[1]["id"] == pipe.experiment
    status, data = post(server, None, path="/v1/models/gpt-4/", method="GET")
    assert status == 404 and data["error"]["code"] == "model_not_found"
    # dipaco's own routes too: FastAPI answered /healthz/ with a 307 to /healthz (issue 76)
    healthy = post(server, None, path="/healthz", method="GET", token=None)
    assert healthy[0] == 200 and post(server, None, path="/healthz/", method="GET", token=None) == healthy  # open
    assert post(server, None, path="/v1/paths/", method="GET")[0] == 200
    routed = {"text": PROMPTS[4]}
    assert post(server, routed, path="/v1/route/") == post(server, routed, path="/v1/route")
    assert post(server, None, path="/nowhere/", method="GET")[0] == 404
    for path, method in (("/v1/completions/", "POST"), ("/v1/completions//", "POST"), ("/v1/models/", "GET")):
        status, data = post(server, body, path=path, token=None, method=method)
        assert status == 401 and data == {"error": {"message": "missing or wrong token: send 'Authorization: Bearer <token>'",
                                                    "type": "authentication_error", "param": None,
                                                    "code": "invalid_api_key"}}
