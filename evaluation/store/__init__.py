"""Records on disk: the results store (``results``), run manifests (``manifest``), the embedded assets (``assets``)."""
