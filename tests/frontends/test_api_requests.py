"""The typed request bodies (api_requests): what a 400 says (the field, the rule, the path) and that the
OpenAPI document is made from the same types (and the answers' from api_responses)."""
from __future__ import annotations

import pytest

from frontends import api_requests as t
from frontends import api_responses as r
from frontends.openapi import openapi_document


@pytest.mark.parametrize("raw, param, words", [
    (b'{"prompt": "hi"}', "model", "'model' is required"),
    (b'[1, 2]', None, "must be a JSON object"),
    (b'{"model": "m", "prompt": "x", "n": 17}', "n", "<= 16"),
    (b'{"model": "m", "prompt": [1, 1180591620717411303424]}', "prompt", "$.prompt[1]"),
    (b'{"model": "m", "prompt": "x", "temperature": true}', "temperature", "got `bool`"),
    (b'{"model": "m", "prompt": "x", "temperature": NaN}', None, "not valid JSON"),
    (b'{"model": "m", "prompt": "caf\xe9"}', None, "not valid UTF-8"),
    (b'{"model": "m", "prompt": "\\ud800"}', None, "\\ud800 is a lone UTF-16 surrogate"),
    (b'{"model": "m", "prompt": "abcd\\udc00b"}', None, "\\udc00 is a lone UTF-16 surrogate"),
    (b'{"model": "m", "prompt": "\\ud800x", }', None, "lone UTF-16 surrogate"),
])
def test_a_bad_completion_body_names_its_field(raw, param, words):
    with pytest.raises(t.DecodeFailure) as e:
        t.decode(raw, t.CompletionRequest)
    assert e.value.param == param and words in e.value.message


def test_a_surrogate_pair_is_one_character_and_unpaired_text_is_not_mistaken_for_one():
    assert t.decode(b'{"model": "m", "prompt": "\\ud83d\\ude00"}', t.CompletionRequest).prompt == "\U0001f600"
    with pytest.raises(t.DecodeFailure) as e:
        t.decode(b'{"model": "m", "prompt": "x",}', t.CompletionRequest)
    assert "surrogate" not in e.value.message and "not valid JSON" in e.value.message


def test_chat_parts_other_than_text_are_refused_with_their_path():
    raw = b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'
    with pytest.raises(t.DecodeFailure) as e:
        t.decode(raw, t.ChatCompletionRequest)
    assert e.value.param == "messages" and "$.messages[0].content[0].type" in e.value.message


def test_a_chat_role_outside_openais_is_refused_with_its_path():
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "hacker", "content": "x"}]}'
    with pytest.raises(t.DecodeFailure) as e:
        t.decode(raw, t.ChatCompletionRequest)
    assert e.value.param == "messages" and "$.messages[1].role" in e.value.message
    for role in ("system", "user", "assistant", "tool", "developer"):
        extra = ', "tool_call_id": "call_1"' if role == "tool" else ""      # a tool turn answers a call
        req = t.decode(b'{"model": "m", "messages": [{"role": "%s", "content": "hi"%s}]}' % (role.encode(),
                                                                                           extra.encode()),
                       t.ChatCompletionRequest)
        assert req.messages[0].role == role


def test_nulls_mean_defaults_and_unknown_fields_are_ignored():
    req = t.decode(b'{"model": "m", "prompt": [1, 2], "n": null, "user": "u", "x-extra": 1}', t.CompletionRequest)
    assert req.prompt == [1, 2] and req.n is None and req.user == "u"


def test_the_document_is_generated_from_the_request_types():
    doc = openapi_document(secured=True)
    schemas = doc["components"]["schemas"]
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    fields = set(t.CompletionRequest.__struct_fields__)
    assert set(schemas["CompletionRequest"]["properties"]) == fields
    assert schemas["CompletionRequest"]["properties"]["n"]["anyOf"][0]["maximum"] == t.MAX_CHOICES
    assert doc["security"] == [{"bearer": []}] and "security" not in openapi_document(secured=False)


def test_the_document_declares_the_answer_structs_the_server_sends():
    doc = openapi_document(secured=False)
    schemas = doc["components"]["schemas"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert chat["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletion"}
    assert chat["text/event-stream"]["x-event-schema"] == {"$ref": "#/components/schemas/ChatCompletionChunk"}
    for struct in (r.Completion, r.ChatCompletion, r.ChatCompletionChunk, r.ModelList, r.StatusReply):
        assert set(schemas[struct.__name__]["properties"]) == set(struct.__struct_fields__)
    assert schemas["ChatChoice"]["properties"]["logprobs"]["anyOf"][0] == {"$ref": "#/components/schemas/ChatLogprobs"}
