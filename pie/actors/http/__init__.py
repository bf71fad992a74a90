"""The http actor: inferlets' outgoing HTTP requests, run on the Trio thread."""

from pie.actors.http.actor import HttpActor, HttpStatistics

__all__ = ["HttpActor", "HttpStatistics"]
