"""Serving a model over HTTP, OpenAI-compatible (`shardlm serve`): request checking and errors
(protocol.py), answers and streamed chunks (responses.py), the thread that owns the engine (worker.py), the
routes (app.py) and the command (command.py). It sits above inference/, whose engine it drives; fastapi and
uvicorn (pip install 'shardlm[serve]') are imported by app.py and command.py alone."""
