//! Prints the device's memory bandwidth in GB/s for the bandwidth bound of decode:
//! `vk_bandwidth [MiB] [reps]` (default 1024 MiB, 20 passes) prints two numbers on one
//! line: the compute-shader read bandwidth (bytes read per second, the bound's denominator)
//! and the copy bandwidth (`vkCmdCopyBuffer`, bytes read + written per second).

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
    let read = vk.read_bandwidth(mib << 20, reps);
    let copy = vk.copy_bandwidth(mib << 20, reps);
    match (read, copy) {
        (Ok(r), Ok(c)) => println!("{:.1} {:.1}", r / 1e9, c / 1e9),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("vk_bandwidth: {e}");
            std::process::exit(1);
        }
    }
}
