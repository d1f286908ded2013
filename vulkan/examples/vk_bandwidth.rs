//! Prints the device's copy bandwidth (GB/s, read + written) for the bandwidth bound of
//! decode: `vk_bandwidth [MiB] [reps]` (default 1024 MiB, 20 copies).

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1024);
    let reps: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(20);
    let vk = match foxedge_vulkan::Vulkan::new() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("vk_bandwidth: no Vulkan device: {e}");
            std::process::exit(1);
        }
    };
    match vk.copy_bandwidth(mib << 20, reps) {
        Ok(bw) => println!("{:.1}", bw / 1e9),
        Err(e) => {
            eprintln!("vk_bandwidth: {e}");
            std::process::exit(1);
        }
    }
}
