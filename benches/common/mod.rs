//! What the benches share.

/// `FOXEDGE_BENCH_LENGTHS` (else `default`): comma-separated token counts, `k` = 1024
/// (e.g. `1k,4k,16k`); counts below 2 are dropped.
pub fn lengths(default: &str) -> Vec<usize> {
    let s = std::env::var("FOXEDGE_BENCH_LENGTHS").unwrap_or_else(|_| default.into());
    s.split(',')
        .filter_map(|x| {
            let x = x.trim();
            match x.strip_suffix(['k', 'K']) {
                Some(n) => n.parse::<usize>().ok().map(|n| n * 1024),
                None => x.parse().ok(),
            }
        })
        .filter(|&n| n >= 2)
        .collect()
}
