"""Search providers: local retrievers over real test collections and real web-search APIs."""
