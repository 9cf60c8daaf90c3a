"""The daemon's wing: registry, fd socket, persistence, auth, server, backends and ops plumbing.
A tool or client never imports this package."""
