"""kdn_compile: GDN, KDA and Diag-KDN for torch.compile / torch.export."""
