fn main() {
    eprintln!("foxedge: the command line is not implemented yet");
    std::process::exit(2);
}
