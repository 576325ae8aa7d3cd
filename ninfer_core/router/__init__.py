"""Several models behind one address (router), model suspend and their lifecycle API."""
