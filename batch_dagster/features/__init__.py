"""The service's features, one module each: a feature's rules and the store queries they need, in one place.

The API's routes, the CLI and the Dagster side's assets and sensors call them; they import neither FastAPI nor
Dagster. Below them: the store (db/), the engine, storage and the pure core (batchfile/).
"""
