//! Cost of small burn ops on the Flex backend (dispatch overhead check).
use std::time::Instant;

use burn::tensor::{Tensor, TensorData};

fn main() {
    let dev = gcs_engine::cpu_device();
    let a: Tensor<2> = Tensor::from_data(TensorData::new(vec![0.5f32; 576], [1, 576]), &dev);
    let n = 2000;
    let t = Instant::now();
    let mut x = a.clone();
    for _ in 0..n {
        x = x + a.clone();
    }
    let _ = x.into_data();
    println!("add [1,576]: {:.2} us/op", t.elapsed().as_secs_f64() * 1e6 / n as f64);
    let t = Instant::now();
    for _ in 0..n {
        let _ = a.clone().into_data().try_into_vec::<f32>().unwrap();
    }
    println!("into_data [1,576]: {:.2} us/op", t.elapsed().as_secs_f64() * 1e6 / n as f64);
    let t = Instant::now();
    for _ in 0..n {
        let _: Tensor<2> = Tensor::from_data(TensorData::new(vec![0.5f32; 576], [1, 576]), &dev);
    }
    println!("from_data [1,576]: {:.2} us/op", t.elapsed().as_secs_f64() * 1e6 / n as f64);
}
