"""What crosses the WebSocket between a client and `pie serve`: the messages, the frame codec and
the authentication challenge. Both the server and the client import it; it imports neither."""
