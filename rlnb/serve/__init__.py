"""An OpenAI-compatible endpoint on the session's engine: bring any agent.

``sess.serve()`` starts an :class:`Endpoint` owned by the session (loopback, a free
port, a bearer token made for it) that serves ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models`` with whatever engine the session has, token
ids, log-probs and policy versions included. An agent (``Task(agent=...)``) gets a
client of it for each episode, and the calls it makes become that episode's sample.
"""

from rlnb.serve._endpoint import Endpoint, EndpointStatistics, ServeConfig

__all__ = ["Endpoint", "EndpointStatistics", "ServeConfig"]
