"""What the tests and the benchmarks share, outside the test suite and outside the product (pyproject.toml ships
g5g and serving only; build.py's commands never import it):

- `server`: start a local server process (`python -m serving`, `build.py serve`, any argv), wait until it answers,
  stop it as `docker stop` does;
- `timed_server`: an OpenAI-compatible chat server whose timing is known exactly (standard library only);
- `pressure`: what other clients send that must not hold up a small chat, and that chat timed beside it;
- `tiny_gemma4`: the tiny Gemma 4 checkpoint, generated and trained here (needs torch and transformers).
"""
