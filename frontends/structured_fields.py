"""The request fields that constrain the output, each mapped to the engine's StructuredOutputsParams:
OpenAI's `response_format` (`json_object`, `json_schema`; `text` is no constraint), vLLM's
`structured_outputs` object and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
A request names at most one constraint; the engine compiles it (a schema, regex or grammar it cannot
compile is a 400 from there)."""
from __future__ import annotations

from frontends.api_error import ApiError
from frontends.api_requests import Generation
from ipc.sampling_params import StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(req: Generation) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from; (None, None) without one. 400 naming the
    fields when it gives more than one."""
    found = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        found.append(("response_format", _response_format(fmt)))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", req.structured_outputs))
    for name, kind in GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, StructuredOutputsParams(**{kind: value})))
    if len(found) > 1:
        raise ApiError(400, f"{' and '.join(name for name, _ in found)}: give one constraint on the output, not "
                       f"{len(found)}", found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


def _response_format(fmt) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ApiError(400, "'response_format': type json_schema needs json_schema.schema (the JSON schema)",
                       "response_format")
    return StructuredOutputsParams(json=fmt.json_schema.schema_)
