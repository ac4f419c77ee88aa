"""Request workflows: who is asking and may they (admission and its accounting), the metered stream, chat
completions, Responses, and the gateway route. Each turns a validated wire request into engine work and
the engine's events back into OpenAI's objects.
"""
