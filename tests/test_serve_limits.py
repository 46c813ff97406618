"""`moembed serve`'s limits and careless-input handling over real HTTP (in-process server, tiny random model):
content type, body bytes held, the character cut, disconnects, the API key's whitespace and key file, 401s in
/metrics. The hostile-client suite with the real command is test_serve_hostile.py."""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest
from test_serve import TEXTS, Spy, engines, held, model_dirs, rows, serving, wait_for  # noqa: F401 - fixtures

from moembed.errors import MoembedError
from moembed.serve.config import ServeConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _count(url: str, endpoint: str, status: int, headers=None) -> float:
    text = httpx.get(f"{url}/metrics", headers=headers).text
    line = f'moembed_requests_total{{endpoint="{endpoint}",status="{status}"}} '
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def test_only_json_bodies_are_read(engines):
    body = b'{"input": ["a"]}'
    with serving(engines["dense"]) as s:
        for ct in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = s.post(content=body, headers={"content-type": ct})
            err = r.json()["error"]
            assert r.status_code == 415 and err["code"] == "unsupported_media_type", (ct, r.text)
            assert "application/json" in err["message"]
        for ct in ("application/json", "application/json; charset=utf-8", "Application/JSON", "application/vnd.x+json"):
            assert rows(s.post(content=body, headers={"content-type": ct})).shape == (1, 32), ct
        assert rows(s.post(content=body)).shape == (1, 32)  # no Content-Type at all: read as JSON
        assert _count(s.url, "embeddings", 415) == 3


def test_body_size_and_bytes_held(engines):
    spy = Spy(engines["dense"])
    with serving(spy, max_request_bytes=1000, max_buffered_bytes=1200) as s:
        r = s.post({"input": ["x" * 2000]})
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
        with held(s, spy, {"input": ["y" * 880]}) as out:  # one admitted request holds its 900 body bytes
            assert s.service.reader.held > 880
            r = s.post({"input": ["z" * 400]})  # 900 + 400 bytes > 1200
            assert r.status_code == 429 and "--max-buffered-bytes" in r.json()["error"]["message"]
            assert r.headers["retry-after"] == "1"
        assert out[0].status_code == 200 and s.service.reader.held == 0
        assert rows(s.post({"input": ["z" * 400]})).shape == (1, 32)


def test_texts_are_cut_to_max_chars_before_tokenizing(engines, monkeypatch):
    seen = []
    tokenize = engines["dense"].tokenize
    monkeypatch.setattr(engines["dense"], "tokenize", lambda texts, *a: seen.append(texts) or tokenize(texts, *a))
    long = "sparse mixture of experts " * 400  # 10,400 characters
    with serving(engines["dense"], max_chars=60) as s:
        got = rows(s.post({"input": ["short", long]}))
        assert seen[-1] == ["short", long[:60]]  # the tokenizer never saw the rest
        np.testing.assert_allclose(got[1], rows(s.post({"input": [long[:60]]}))[0], rtol=0, atol=1e-6)
    assert ServeConfig(model="m").chars(256) == 8192  # default: 32 characters per token of the maximum length
    with serving(engines["dense"], max_chars=60, auto_truncate=False) as s:
        r = s.post({"input": ["short", long]})
        err = r.json()["error"]
        assert r.status_code == 413 and err["param"] == "input" and err["message"].startswith("input[1]: 10400 characters")
        assert "--max-chars" in err["message"]


def test_a_client_that_leaves_is_a_499_and_its_texts_are_dropped(engines):
    spy = Spy(engines["dense"])
    with serving(spy) as s:
        with held(s, spy):
            with pytest.raises(httpx.ReadTimeout):  # gives up and closes its connection while its texts are queued
                httpx.post(f"{s.url}/v1/embeddings", json={"input": [f"gone {i}" for i in range(50)]}, timeout=0.5)
            assert wait_for(lambda: _count(s.url, "embeddings", 499))
        assert rows(s.post({"input": ["after"]})).shape == (1, 32)
        assert _count(s.url, "embeddings", 499) == 1 and _count(s.url, "embeddings", 500) == 0
    gone = {tuple(x) for x in engines["dense"].tokenize([f"gone {i}" for i in range(50)])[0]}
    assert not gone & {x for b in spy.batches for x in b}  # none of its texts went through a pass


def test_api_key_whitespace_401_metrics_and_key_file(engines, tmp_path):
    with serving(engines["dense"], api_key="  s3cret \n") as s:  # as pasted from a file or a terminal
        auth = {"authorization": "Bearer s3cret"}
        assert rows(s.post({"input": "a"}, headers=auth)).shape == (1, 32)
        assert s.post({"input": "a"}, headers={"authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{s.url}/v1/models").status_code == 401
        assert httpx.get(f"{s.url}/metrics").status_code == 401
        assert _count(s.url, "embeddings", 401, auth) == 1
        assert _count(s.url, "models", 401, auth) == 1 and _count(s.url, "metrics", 401, auth) == 1
    key = tmp_path / "key"
    key.write_text("k3y-from-file\n")
    os.chmod(key, 0o600)
    assert ServeConfig.from_flags(model="m", api_key_file=str(key)).api_key.get_secret_value() == "k3y-from-file"
    with pytest.raises(MoembedError, match="--api-key-file: give the key one way"):
        ServeConfig.from_flags(model="m", api_key_file=str(key), api_key="other")
    os.chmod(key, 0o644)
    with pytest.raises(MoembedError, match=r"--api-key-file: .*readable by other users.*chmod 600"):
        ServeConfig.from_flags(model="m", api_key_file=str(key))
    with pytest.raises(MoembedError, match="--api-key-file: .*cannot read"):
        ServeConfig.from_flags(model="m", api_key_file=str(tmp_path / "missing"))
    with pytest.raises(MoembedError, match="--api-key: must be printable ASCII without spaces"):
        ServeConfig.from_flags(model="m", api_key="two words")
    with pytest.raises(MoembedError, match="--max-buffered-bytes .* must be at least --max-request-bytes"):
        ServeConfig.from_flags(model="m", max_request_bytes=100, max_buffered_bytes=10)
