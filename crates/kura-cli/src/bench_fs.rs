//! `kura bench fs`: fio under the preload library against ext4 on the same disk (paper 004,
//! Fig. 5-7).

use clap::Args;

#[derive(Args, Clone, Debug)]
pub struct FsBenchArgs {
    /// Also write the JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

pub fn run(_args: &FsBenchArgs) -> anyhow::Result<()> {
    anyhow::bail!("kura bench fs: not built yet")
}
