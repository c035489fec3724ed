"""The browser viewer (viser): a trained run (`gstrain view`) or a run while it trains (`fit --viewer`)."""
