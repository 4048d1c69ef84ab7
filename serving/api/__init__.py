"""The HTTP layer: the app (app.py), the OpenAI wire format (protocol.py), what every request passes through
(middleware.py), the completion endpoints (completions.py), their JSON and SSE answers (answers.py), the tokenize
endpoints (tokenize.py). It imports the engine core and request shaping, never the other way round."""
