"""Infrastructure every app shares, and no app owns: database work from async code, and the Redis clients.

Not a Django app: nothing here has models. It imports only Django and client libraries, never an app.
"""
