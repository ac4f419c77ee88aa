"""The generation engine: catalog lookups, prompting (chat templates, token counts, the context check),
decoding (output constraints, tool calls and reasoning read back from text), generation, dispatch to the
embedded pool or Celery workers, execution on this process's runners, and ``runners/``.

It knows nothing of HTTP or of OpenAI's shapes: it raises the domain exceptions of ``exceptions``.
"""
