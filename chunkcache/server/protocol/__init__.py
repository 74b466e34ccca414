"""The wire format of the OpenAI-compatible API: request and response models, one module per
route family as in `server/routes/` (completions, chat, chunk_cache, admin), with what they share
(the strict base model, the sampling fields, usage, errors) in `common.py`.

Requests are strict on purpose: a field this server does not implement is rejected with HTTP 400
naming it (pydantic's `extra="forbid"`), because silently ignoring it returns an answer the client
did not ask for. Every optional field also takes an explicit `null` (= its default), as OpenAI's
API does. Fields with no effect on the answer are accepted where they mean nothing here (`user`,
`metadata`, `store=false`, `tools=[]`, `tool_choice="none"`, `response_format={"type": "text"}`,
...), and refused with a 400 saying why where they would (`store=true`, non-empty `tools`, JSON
response formats). docs/compatibility.md lists every field.

Value checks that belong to sampling (ranges of temperature, top_p, ...) are left to
`SamplingParams`, the one place that knows them; these models check shapes and the OpenAI-only rules.
"""
