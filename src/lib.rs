//! foxedge: the facade. Backend selection, the FoX model runner, sessions.
