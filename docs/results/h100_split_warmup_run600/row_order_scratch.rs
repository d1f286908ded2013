// Row norms of 16 heads x 4096 rows x 64 (q and k), caches evicted first: head by head
// (rows 16 heads apart) against one pass in memory order. One thread.
//     rustc -O row_order_scratch.rs && ./row_order_scratch
use std::time::Instant;
fn sq(x:&[f32])->f64{ x.iter().map(|v| f64::from(*v)*f64::from(*v)).sum::<f64>() }
fn main(){
    let (t,nh,d)=(4096usize,16usize,64usize);
    let q:Vec<f32>=(0..t*nh*d).map(|i| ((i*2654435761usize)%1000) as f32/1000.0-0.5).collect();
    let k:Vec<f32>=(0..t*nh*d).map(|i| ((i*2246822519usize)%1000) as f32/1000.0-0.5).collect();
    // evict
    let big:Vec<u8>=vec![1;256<<20];
    for _ in 0..4 {
      let s:u64=big.iter().step_by(64).map(|&b| b as u64).sum(); std::hint::black_box(s);
      let t0=Instant::now(); let mut m=vec![0.0f64;nh];
      for h in 0..nh { let (mut qn,mut kn)=(0.0f64,0.0f64); for r in 0..t { qn=qn.max(sq(&q[(r*nh+h)*d..][..d])); kn=kn.max(sq(&k[(r*nh+h)*d..][..d])); } m[h]=qn.sqrt()*kn.sqrt(); }
      let e0=t0.elapsed();
      let s:u64=big.iter().step_by(64).map(|&b| b as u64).sum(); std::hint::black_box(s);
      let t1=Instant::now(); let (mut qm,mut km)=(vec![0.0f64;nh],vec![0.0f64;nh]);
      for r in 0..t { for h in 0..nh { qm[h]=qm[h].max(sq(&q[(r*nh+h)*d..][..d])); km[h]=km[h].max(sq(&k[(r*nh+h)*d..][..d])); } }
      let e1=t1.elapsed();
      println!("cold: per-head strided {:?}  row-major {:?}  {}", e0, e1, (m[3]-qm[3].sqrt()*km[3].sqrt()).abs());
    }
}
