"""The OpenAI wire format: typed request models and response builders, named after OpenAI's objects.

Used by ``inference.api`` and ``inference.serving`` (and the agent runtime's own wire format), never by
the engine: below the serving layer nothing knows OpenAI's shapes.
"""
